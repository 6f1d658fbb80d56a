"""Step metrics: throughput and MFU from a FLOPs model, distributions, and metrics.jsonl."""

import json
import pathlib
import time
from collections.abc import Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from jaxdist.layout import spec


def throughput(
    step_time_s: float,
    tokens_per_step: int,
    flops_per_token: float,
    num_devices: int,
    peak_flops_per_device: float | None,
) -> dict[str, float | None]:
    tokens_per_s = tokens_per_step / step_time_s
    model_flops = tokens_per_s * flops_per_token
    mfu = None
    if peak_flops_per_device:
        mfu = model_flops / (num_devices * peak_flops_per_device)
    return {"tokens_per_s": tokens_per_s, "model_tflops": model_flops / 1e12, "mfu": mfu}


def distribution(values: list[float]) -> dict[str, float]:
    """p50/p90/max: one average hides the stragglers that fleet-scale training dies of."""
    if not values:
        return {}
    a = np.asarray(values)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "max": float(a.max()),
        "mean": float(a.mean()),
        "n": len(values),
    }


class MetricsLog:
    """Appends one JSON object per logged step; opened by the process that writes logs.

    A run killed mid-write leaves a partial last line; it is cut off before appending, so the
    file stays one valid object per line. A resumed run appends: where it recomputes steps,
    the later line for a step is the one that counts.

    `sinks`: each gets every record too, and must not make the loop wait (they queue it for a
    thread of their own: jaxdist.metrics.tensorboard.TensorBoardLog,
    jaxdist.metrics.wandb_log.WandbLog). `stamp`: fields added to every record as it is written
    (the goodput ledger's running totals, so that a killed run's accounting survives).
    """

    def __init__(self, path: pathlib.Path, *sinks, stamp: Callable[[], dict] | None = None):
        self.path, self.sinks, self.stamp = path, sinks, stamp
        if path.exists():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                with path.open("r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        """One record, stamped with the wall-clock time it was written (Unix seconds)."""
        record = {**record, **(self.stamp() if self.stamp else {}), "time": time.time()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        """Closes the file, then each sink (which writes out what it has queued)."""
        if not self._file.closed:
            self._file.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = ()


def read_metrics(path: pathlib.Path) -> list[dict]:
    """Every complete record; a partial last line (a killed writer) is ignored."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def latest_per_step(records: list[dict]) -> dict[int, dict]:
    """Step -> its last logged record: after a resume, recomputed steps supersede."""
    return {r["step"]: r for r in records if "loss" in r}


def print_summary(console: Console, s: dict) -> None:
    mesh = spec(s["mesh"]) if isinstance(s["mesh"], dict) else s["mesh"]
    table = Table(title=f"{s['model']} on {mesh}", show_header=False)
    st, ck = s["step_time_s"], s["checkpoint_blocked_s"]

    def ms(d: dict) -> str:
        if not d:
            return "n/a (too few)"
        return f"{d['p50'] * 1e3:.1f} / {d['p90'] * 1e3:.1f} / {d['max'] * 1e3:.1f} ms"

    rows = [
        ("loss", f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}" if s["final_loss"] else "-"),
        *_eval_row(s.get("eval_loss")),
        ("step time p50 / p90 / max", ms(st)),
        ("tokens/s (p50 step)", f"{s['tokens_per_s']:,.0f}"),
        ("model TFLOP/s", f"{s['model_tflops']:.3f}"),
        ("MFU", f"{s['mfu']:.1%}" if s["mfu"] is not None else "n/a (unknown peak; --peak-tflops)"),
        ("checkpoint blocked p50 / p90 / max", ms(ck)),
        ("checkpoint share of wall", f"{s['checkpoint_fraction_of_wall']:.2%}"),
        ("skipped (non-finite) steps", str(len(s["skipped_steps"]))),
        ("wall", f"{s['wall_s']:.1f} s"),
        *_rounds_row(s.get("rounds")),
        *_goodput_row(s.get("goodput")),
        ("run dir", s["run_dir"]),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


def _eval_row(e: dict | None) -> list[tuple[str, str]]:
    return [(f"eval loss (step {e['step']})", f"{e['loss']:.4f}")] if e else []


def _goodput_row(g: dict | None) -> list[tuple[str, str]]:
    if not g or g.get("goodput") is None:
        return []
    n = g["attempts"]
    text = f"{g['goodput']:.1%} of {g['wall_s']:.1f} s, {n} attempt{'s' if n > 1 else ''}"
    return [("goodput (productive / all attempts' wall)", text)]


def _rounds_row(r: dict | None) -> list[tuple[str, str]]:
    """The replica groups' outer rounds (jaxdist.metrics.outer's summary)."""
    if not r:
        return []
    F = r["fragments"]
    every = f"every {r['every_steps']} steps" + (f", {F} fragments" if F > 1 else "")
    if not r["count"]:
        return [("replica rounds (groups met)", f"none ({every}; the run ended first)")]
    share = f"{r['outer_share']:.1%}" if r["outer_share"] is not None else "n/a (too few steps)"
    rows = [
        ("replica rounds (groups met)", f"{r['count']} ({every})"),
        ("sent per round, per device", f"{r['bytes_per_round'] / 1e6:.3f} MB"),
        ("outer step share of step time", share),
    ]
    if r["steps_after_last"]:
        after = f"{r['steps_after_last']} (not in the outer weights: eval and export miss them)"
        rows.append(("steps since the last round", after))
    return rows
