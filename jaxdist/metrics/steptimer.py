"""Step time as the loop sees it, without stalling the device: each step's interval, its
throughput and MFU, the log line and the bar (progress), the watchdog's feed, and the run's
summary.json."""

import time

import jax
import numpy as np

from jaxdist import hardware
from jaxdist.cluster.join import metric_value
from jaxdist.metrics.progress import Bar, recent_median, step_line, time_left
from jaxdist.metrics.records import distribution, throughput


class StepTimer:
    """Times each step from one finished step to the next, logs it, and feeds the watchdog.

    Step s's interval ends when its scalars arrive, which blocks only until s is done: s+1 is
    already queued. Time the loop spent between steps (a save, an evaluation) is excluded
    (`exclude`)."""

    def __init__(self, model, data, loop, start, capture, watchdog, log, console, ledger):
        self.model, self.loop, self.start, self.ledger = model, loop, start, ledger
        self.capture, self.watchdog, self.log, self.console = capture, watchdog, log, console
        self.tokens_per_step = data.batch_size * model.seq_len
        self.peak = hardware.peak_flops(jax.devices()[0], loop.peak_tflops)
        self.step_times: list[float] = []  # steady-state steps only
        self.bar = Bar(console, loop.steps, start)  # drawn while the loop runs (`with`)
        self.records: list[dict] = []
        self._t_prev = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Work between steps (a save, an evaluation) took `seconds`: not the next step's time,
        and not a stall (the watchdog is told)."""
        self._t_prev += seconds
        self.watchdog.alive()

    def p50(self) -> float | None:
        return float(np.median(self.step_times)) if self.step_times else None

    def throughput(self, step_time_s: float) -> dict:
        return throughput(
            step_time_s,
            self.tokens_per_step,
            self.model.flops_per_token,
            jax.device_count(),
            self.peak,
        )

    def finish(self, s: int, metrics: dict, extra: dict | None = None) -> dict:
        """Step s's record, logged every log_every steps; `extra` joins it (the mixture's
        realised proportions)."""
        values = {k: metric_value(k, v) for k, v in metrics.items()}
        now = time.perf_counter()
        dt, self._t_prev = now - self._t_prev, now
        self.ledger.step(s)
        # The first step compiles, the second's interval holds warm-up, traced steps run
        # synchronously: none of them is a steady-state step time.
        traced = self.capture.traced(s) or self.capture.traced(s - 1)
        if s >= self.start + 2 and not traced:
            self.step_times.append(dt)
        rec = {
            "step": s,
            **values,
            "finite": bool(values["finite"]),
            "step_time_s": dt,
            **self.throughput(dt),
            **(extra or {}),
        }
        self.records.append(rec)
        median = recent_median(self.step_times)
        self.watchdog.finished(s, median if len(self.step_times) >= 3 else None)
        last = s == self.loop.steps - 1
        left = time_left(median, self.loop.steps - 1 - s)
        self.bar.update(rec, left)
        if self.log and (s % self.loop.log_every == 0 or last or not rec["finite"]):
            self.log.write(rec)
            self.console.print(step_line(rec, self.loop.steps, left), highlight=False)
        return rec


def summarize(model, jitted, mesh, loop, start, preempted, timer: StepTimer, saves, wall):
    """summary.json: losses, step-time and save-cost distributions, throughput."""
    records = timer.records
    stats = distribution(timer.step_times)
    steady = stats.get("p50") or (records[-1]["step_time_s"] if records else float("nan"))
    return {
        "model": model.name,
        "params": jitted.num_params,
        "mesh": dict(mesh.shape),
        "steps": loop.steps,
        "start_step": start,
        "preempted_at": preempted and preempted[0],
        "final_loss": records[-1]["loss"] if records else None,
        "first_loss": records[0]["loss"] if records else None,
        "skipped_steps": [r["step"] for r in records if not r["finite"]],
        "step_time_s": stats,
        "compile_and_first_step_s": records[0]["step_time_s"] if records else None,
        "checkpoint_blocked_s": distribution(saves),
        "checkpoint_blocked_total_s": sum(saves),
        "checkpoint_fraction_of_wall": sum(saves) / wall,
        "wall_s": wall,
        **timer.throughput(steady),
    }
