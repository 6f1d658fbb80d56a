"""Step time as the loop sees it, without stalling the device: each step's interval, its
throughput and MFU, the log line and the bar (progress), the watchdog's feed, the outer rounds
of replica groups (jaxdist.metrics.outer), and the run's summary.json.

A compile is no step's time. The attempt's first step compiles (its interval is reported as
compile and first step); a later step whose program is new (the first outer round of replica
groups: `before` is told each step's static part) compiles when it is dispatched: the step
before it is waited for first, so that its time stays its own, and the compile's seconds (as
JAX reports them, jaxdist.metrics.compiles) are kept out of both. A compile nobody foresaw is
taken out of the interval it fell in, and that interval is no steady step time.
"""

import time

import jax
import numpy as np

from jaxdist import hardware
from jaxdist.cluster.join import metric_value
from jaxdist.metrics import outer
from jaxdist.metrics.compiles import Clock
from jaxdist.metrics.progress import Bar, recent_median, step_line, time_left
from jaxdist.metrics.records import distribution, throughput


class StepTimer:
    """Times each step from one finished step to the next, logs it, and feeds the watchdog.

    Step s's interval ends when its scalars arrive, which blocks only until s is done: s+1 is
    already queued. Time the loop spent between steps (a save, an evaluation) is excluded
    (`exclude`)."""

    def __init__(
        self, model, data, loop, start, capture, watchdog, log, console, ledger, rounds=None
    ):
        self.model, self.loop, self.start, self.ledger = model, loop, start, ledger
        self.capture, self.watchdog, self.log, self.console = capture, watchdog, log, console
        self.rounds: outer.Rounds | None = rounds  # with replica groups
        self.tokens_per_step = data.batch_size * model.seq_len
        self.peak = hardware.peak_flops(jax.devices()[0], loop.peak_tflops)
        self.step_times: list[float] = []  # steady-state steps only
        self.bar = Bar(console, loop.steps, start)  # drawn while the loop runs (`with`)
        self.records: list[dict] = []
        self._t_prev = time.perf_counter()
        self._compiles = Clock()  # the loop's thread's
        self._compiled = self._compiles.seconds()  # at the start of the current interval
        self._acts: dict[int, object] = {}  # steps dispatched, not finished: their static part
        self._seen: set = set()  # the static parts dispatched: each compiled once
        self._settled: tuple[float, float] | None = None  # (time, compiled) the step ended
        self._compile_before: dict[int, float] = {}  # step -> its program's compile seconds

    def before(self, s: int, act, state) -> None:
        """Step s is about to be dispatched with static part `act` (the outer step's part:
        rounds.action). A new one compiles at dispatch: the step in flight is waited for first
        (`state`, its output), so that the compile is neither its time nor the next's."""
        self._acts[s] = act
        if act in self._seen:
            return
        self._seen.add(act)
        if s > self.start:
            jax.block_until_ready(state)
            self._settled = (time.perf_counter(), self._compiles.seconds())

    def exclude(self, seconds: float) -> None:
        """Work between steps (a save, an evaluation) took `seconds`: not the next step's time,
        and not a stall (the watchdog is told). What it compiled is its own (goodput says)."""
        self._t_prev += seconds
        self._compiled = self._compiles.seconds()
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
        dt, unforeseen = self._interval(s)
        self.ledger.step(s)
        # The first step compiles, the second's interval holds warm-up, as does a new
        # program's first run; traced steps run synchronously; an interval a compile fell in
        # was shared: none is a steady step time.
        traced = self.capture.traced(s) or self.capture.traced(s - 1)
        fresh = s in self._compile_before
        steady = s >= self.start + 2 and not traced and not unforeseen and not fresh
        if steady:
            self.step_times.append(dt)
        compiled = self._compile_before.pop(s, 0.0) + unforeseen
        rec = {
            "step": s,
            **values,
            "finite": bool(values["finite"]),
            "step_time_s": dt,
            **self.throughput(dt),
            **({"compile_s": compiled} if compiled else {}),
            **(extra or {}),
        }
        self.records.append(rec)
        act = self._acts.pop(s, None)
        rnd = self.rounds.step(s, act, dt, steady, compiled) if self.rounds else None
        median = recent_median(self.step_times)
        self.watchdog.finished(s, median if len(self.step_times) >= 3 else None)
        last = s == self.loop.steps - 1
        left = time_left(median, self.loop.steps - 1 - s)
        self.bar.update(rec, left)
        # A step that ran an outer round always has its line, marked, and its round's record.
        if self.log and (s % self.loop.log_every == 0 or last or not rec["finite"] or rnd):
            self.log.write(rec)
            first = "| compile included (the attempt's first step)" if s == self.start else ""
            mark = "  ".join(m for m in (first, outer.mark(rnd) if rnd else "") if m)
            self.console.print(step_line(rec, self.loop.steps, left, mark), highlight=False)
        if self.log and rnd:
            self.log.write(rnd)
        return rec

    def _interval(self, s: int) -> tuple[float, float]:
        """Step s's time (from the previous step's end), and the compile seconds JAX reported
        inside it that nobody foresaw (taken out of it; the first step's stay: it compiles).
        A step waited for before a new program compiled (`before`) ended then; the compile's
        seconds are the next step's program's."""
        now, compiled_now = time.perf_counter(), self._compiles.seconds()
        end, compiled_end = self._settled or (now, compiled_now)
        unforeseen = compiled_end - self._compiled if s > self.start else 0.0
        dt = end - self._t_prev - unforeseen
        if self._settled is not None:
            self._compile_before[s + 1] = compiled_now - compiled_end
        self._t_prev, self._compiled, self._settled = now, compiled_now, None
        return dt, unforeseen


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
        **({"rounds": timer.rounds.summary(loop.steps)} if timer.rounds else {}),
    }
