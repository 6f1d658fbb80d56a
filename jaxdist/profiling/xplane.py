"""Step-time attribution: where every millisecond of a step went, per device.

Reads any JAX trace (`.xplane.pb`, through `jax.profiler.ProfileData`), finds the steps, and
splits each step window W of each device into compute C, collectives M and memory copies X by
interval-set arithmetic. Exposed time and idle are what the sets leave, so by construction

    |W| = |C| + |M \\ C| + |X \\ (C u M)| + idle

`comm_overlapped_s = |M n C|` is communication hidden behind compute, `comm_exposed_s` the rest.
A collective instance seen on several devices took, on each, the transfer plus the wait for
the last peer to arrive; the shortest of them is the transfer, each device's excess is its sync
wait (T_sync), and the device that waited least is the straggler the others waited for.
"""

import dataclasses
import pathlib
import re
from collections import defaultdict

from jaxdist.compiled.hlo import COLLECTIVES, opcode
from jaxdist.errors import ConfigError

# Control-flow ops enclose the ops they run; only the ops inside are time spent.
_CONTAINERS = ("while", "conditional", "call", "command_buffer")
_NCCL = re.compile(r"(?i)nccl|rccl|allreducekernel|all_reduce|allgather|reducescatter")
_MEMCPY = re.compile(r"(?i)^memcpy|^memset|memcpy\d*$")
_DEVICE_PLANE = re.compile(r"^/device:(GPU|TPU):(\d+)")


@dataclasses.dataclass(frozen=True)
class Event:
    device: int
    name: str  # hlo_op where known, else the kernel name
    kind: str  # compute | collective | memcpy
    start: float  # ns
    end: float
    run_id: int | None = None


@dataclasses.dataclass
class Trace:
    events: list[Event]
    steps: list[tuple[int, float, float]]  # (step number, start ns, end ns) of annotations
    source: str
    platform: str


def find_xplane(path: str | pathlib.Path) -> pathlib.Path:
    p = pathlib.Path(path)
    if p.is_dir():
        found = sorted(p.rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
        if not found:
            raise ConfigError(
                f"no .xplane.pb trace under {p}; pass a jax.profiler trace "
                "directory or the .xplane.pb file itself"
            )
        return found[-1]
    if not p.exists():
        raise ConfigError(f"trace {p} does not exist")
    return p


def _classify(name: str, hlo_op: str | None) -> str | None:
    op = opcode(hlo_op) if hlo_op else None
    if op in _CONTAINERS or (op is None and name.split(".")[0] in _CONTAINERS):
        return None
    if op in COLLECTIVES or _NCCL.search(name):
        return "collective"
    # `opcode` folds an async pair into its op, and a plain copy (a layout change) is compute.
    if _MEMCPY.search(name) or (op == "copy" and hlo_op != opcode(hlo_op)):
        return "memcpy"
    return "compute"


def load(path: str | pathlib.Path) -> Trace:
    """Device op events and step annotations of a trace, for CPU, GPU or TPU alike."""
    from jax.profiler import ProfileData

    f = find_xplane(path)
    if f.stat().st_size == 0:
        raise ConfigError(f"trace {f} is empty; capture it again")
    try:
        data = ProfileData.from_file(str(f))
        planes = list(data.planes)
    except Exception as e:  # noqa: BLE001 - the reader raises several types for bad bytes
        raise ConfigError(
            f"trace {f} is not a readable XSpace ({type(e).__name__}); pass "
            "the .xplane.pb that jax.profiler wrote"
        ) from None
    events: list[Event] = []
    steps: list[tuple[int, float, float]] = []
    platform = "cpu"
    for plane in planes:
        device_match = _DEVICE_PLANE.match(plane.name)
        if device_match:
            platform = device_match.group(1).lower()
        if not device_match and plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if device_match and line.name in (
                "XLA Modules",
                "Steps",
                "XLA TraceMe",
                "Framework Ops",
                "Source code",
                # XLA's CUPTI collector puts the profiler's own buffer flushes here
                "CUPTI overhead",
            ):
                continue  # derived, host-side or profiler lines, not device activity
            for e in line.events:
                stats = {k: v for k, v in e.stats if k is not None}
                if "step_num" in stats and not device_match:
                    steps.append((int(stats["step_num"]), e.start_ns, e.end_ns))
                    continue
                if device_match:
                    device = int(device_match.group(2))
                elif "device_ordinal" in stats and "hlo_op" in stats:
                    device = int(stats["device_ordinal"])
                else:
                    continue
                if e.name.startswith("end: "):
                    continue  # completion marker of an async op, not time spent
                kind = _classify(e.name, stats.get("hlo_op"))
                if kind is None or e.duration_ns <= 0:
                    continue
                name = stats.get("hlo_op") or e.name
                run_id = stats.get("run_id")
                events.append(
                    Event(
                        device,
                        name,
                        kind,
                        e.start_ns,
                        e.end_ns,
                        int(run_id) if run_id is not None else None,
                    )
                )
    if not events:
        raise ConfigError(
            f"trace {f} holds no device op events; on CPU capture with "
            "XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true (jaxdist train --profile does)"
        )
    steps.sort(key=lambda s: s[1])
    return Trace(events, steps, str(f), platform)


def step_windows(trace: Trace) -> list[tuple[int, float, float]]:
    """(step, start, end): from step annotations, else one per execution (run_id), else all.

    An annotated step's window runs to the later of its annotation's end and the end of the
    device work that started before the next step began (dispatch is asynchronous).
    """
    ev = sorted(trace.events, key=lambda e: e.start)
    if trace.steps:
        out = []
        for i, (num, start, end) in enumerate(trace.steps):
            nxt = trace.steps[i + 1][1] if i + 1 < len(trace.steps) else float("inf")
            ends = [e.end for e in ev if start <= e.start < nxt]
            out.append((num, start, max([end, *ends])))
        return out
    by_run: dict[int, list[Event]] = defaultdict(list)
    for e in ev:
        if e.run_id is not None:
            by_run[e.run_id].append(e)
    if by_run:
        # The main program is the one with the most device time; others (init, logging) are
        # not steps.
        spans = sorted(
            (min(x.start for x in es), max(x.end for x in es), sum(x.end - x.start for x in es))
            for es in by_run.values()
        )
        top = max(s[2] for s in spans)
        spans = [s for s in spans if s[2] >= 0.5 * top]
        return [(i, s, e) for i, (s, e, _) in enumerate(spans)]
    return [(0, ev[0].start, max(e.end for e in ev))]
