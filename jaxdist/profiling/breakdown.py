"""The per-step, per-device breakdown of a trace into compute, communication, sync and idle."""

import bisect
from collections import defaultdict

import numpy as np

from jaxdist.layout import REPLICA
from jaxdist.profiling import spans as iv
from jaxdist.profiling.xplane import Event, Trace, step_windows

NS = 1e-9


def breakdown(
    trace: Trace,
    axes_of: dict[str, str] | None = None,
    bytes_of: dict[str, int] | None = None,
    per_step: dict[int, tuple[dict, dict]] | None = None,
) -> dict:
    """`breakdown.json`'s content. `axes_of` / `bytes_of` map a collective's HLO name to the
    mesh axes it spans and its bytes per execution (from the compiled HLO, when known);
    `per_step`: the same for steps that ran another program (replica groups' outer step)."""
    axes_of, bytes_of, per_step = axes_of or {}, bytes_of or {}, per_step or {}
    by_device: dict[int, list[Event]] = defaultdict(list)
    for e in trace.events:
        by_device[e.device].append(e)
    starts = {}
    for d, es in by_device.items():
        es.sort(key=lambda e: e.start)
        starts[d] = [e.start for e in es]

    rows = []
    for num, ws, we in step_windows(trace):
        window = {
            d: es[bisect.bisect_left(starts[d], ws) : bisect.bisect_left(starts[d], we)]
            for d, es in by_device.items()
        }
        sync = _sync(window)
        axes, nbytes = per_step.get(num, (axes_of, bytes_of))
        for d in sorted(window):
            rows.append(_device_step(num, d, ws, we, window[d], sync.get(d, 0.0), axes, nbytes))
    if not rows:
        raise ValueError("the trace has device events but no step windows hold any")
    return {
        "source": trace.source,
        "platform": trace.platform,
        "steps": rows,
        "summary": summarize(rows),
    }


def _sync(window: dict[int, list[Event]]) -> dict[int, float]:
    """Per device, the seconds its collectives spent waiting for the slowest peer."""
    durations: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for d, es in window.items():
        seen: dict[str, int] = defaultdict(int)
        for e in es:
            if e.kind == "collective":
                k = seen[e.name]
                seen[e.name] += 1
                durations[(e.name, k)][d] = e.end - e.start
    wait: dict[int, float] = defaultdict(float)
    for per_device in durations.values():
        if len(per_device) < 2:
            continue
        transfer = min(per_device.values())
        for d, dur in per_device.items():
            wait[d] += (dur - transfer) * NS
    return wait


def _device_step(num, d, ws, we, events, sync_s, axes_of, bytes_of) -> dict:
    comp = iv.union(iv.clip([(e.start, e.end) for e in events if e.kind == "compute"], ws, we))
    coll = iv.union(iv.clip([(e.start, e.end) for e in events if e.kind == "collective"], ws, we))
    mem = iv.union(iv.clip([(e.start, e.end) for e in events if e.kind == "memcpy"], ws, we))
    overlapped = iv.measure(iv.intersect(coll, comp))
    # Replica groups meet only in the outer step: its collectives are those over `replica`
    # (but the logged metrics' scalars, which every step reduces over the whole batch).
    outer = [(e.start, e.end) for e in events if _outer(e, axes_of, bytes_of)]
    outer = iv.union(iv.clip(outer, ws, we))
    comm = iv.measure(coll)
    mem_exposed = iv.measure(iv.subtract(mem, iv.union(comp + coll)))
    busy = iv.measure(iv.union(comp + coll + mem))
    by_axis: dict[str, dict] = {}
    groups: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for e in events:
        if e.kind == "collective":
            groups[(axes_of.get(e.name, "unknown"), e.name.split(".")[0])].append(e)
    for (axis, kind), es in groups.items():
        spans = iv.union(iv.clip([(e.start, e.end) for e in es], ws, we))
        t = iv.measure(spans) * NS
        nbytes = sum(bytes_of.get(e.name, 0) for e in es)
        entry = by_axis.setdefault(axis, {})
        entry[kind] = {
            "count": len(es),
            "time_s": t,
            "exposed_s": iv.measure(iv.subtract(spans, comp)) * NS,
            "bytes": nbytes,
            "gbytes_per_s": (nbytes / t / 1e9) if t and nbytes else None,
        }
    return {
        "step": num,
        "device": d,
        "step_s": (we - ws) * NS,
        "compute_s": iv.measure(comp) * NS,
        "comm_s": comm * NS,
        "comm_exposed_s": (comm - overlapped) * NS,
        "comm_overlapped_s": overlapped * NS,
        "sync_s": sync_s,
        "outer_s": iv.measure(outer) * NS,
        "outer_exposed_s": iv.measure(iv.subtract(outer, comp)) * NS,
        "memcpy_s": iv.measure(mem) * NS,
        "memcpy_exposed_s": mem_exposed * NS,
        "idle_s": ((we - ws) - busy) * NS,
        "by_axis": by_axis,
    }


def _outer(e: Event, axes_of: dict[str, str], bytes_of: dict[str, int]) -> bool:
    """A collective of the replica groups' outer step: over `replica`, and more than the few
    scalars of the logged metrics."""
    if e.kind != "collective" or REPLICA not in axes_of.get(e.name, "").split("+"):
        return False
    return bytes_of.get(e.name, 0) > 64


def summarize(rows: list[dict]) -> dict:
    """Fractions of step time, distributions over steps, and the straggler of each step."""
    keys = (
        "step_s",
        "compute_s",
        "comm_s",
        "comm_exposed_s",
        "comm_overlapped_s",
        "sync_s",
        "outer_s",
        "outer_exposed_s",
        "memcpy_exposed_s",
        "idle_s",
    )
    mean = {k: float(np.mean([r.get(k, 0.0) for r in rows])) for k in keys}
    steps = sorted({r["step"] for r in rows})
    step_times = [max(r["step_s"] for r in rows if r["step"] == s) for s in steps]
    stragglers = []
    for s in steps:
        rs = [r for r in rows if r["step"] == s]
        if len(rs) > 1 and any(r["sync_s"] > 0 for r in rs):
            late = min(rs, key=lambda r: r["sync_s"])
            others = [r["sync_s"] for r in rs if r is not late]
            stragglers.append(
                {"step": s, "device": late["device"], "others_waited_s": float(np.mean(others))}
            )
    axis_totals: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        for axis, kinds in r["by_axis"].items():
            for kind, v in kinds.items():
                for f in ("time_s", "exposed_s", "bytes"):
                    axis_totals[f"{axis}/{kind}"][f] += v[f] / len(rows)  # per device-step
    step = mean["step_s"] or 1.0
    return {
        "steps": len(steps),
        "devices": len({r["device"] for r in rows}),
        "mean_per_device": mean,
        "fraction_of_step": {k: mean[k] / step for k in keys if k != "step_s"},
        "step_time_s": {
            "p50": float(np.percentile(step_times, 50)),
            "p90": float(np.percentile(step_times, 90)),
            "max": float(max(step_times)),
        },
        "stragglers": stragglers,
        "per_axis_per_step": {k: dict(v) for k, v in axis_totals.items()},
    }
