"""Slow steps reported, hangs ended: the run's watchdog, a background thread in every process.

Each process posts its progress to the coordination service's key-value store (one small RPC
per step on the host, never touching the device): the last step it finished and the step it
has entered (dispatched). A background thread compares the time since the last finished step
with two limits:
- `factor` x the p50 step: one "slow step" line naming the processes not yet arrived;
- the hang timeout (`--hang-timeout`, default the larger of 600 s and 20 x p50): the run is
  declared hung. Every process names the stuck ones (index, host, last finished step); a
  stuck process writes its Python stacks to its log (faulthandler: where it is stuck); all
  exit with HANG_EXIT (124), so `launch`, Slurm and a restart policy see a failure.

A process "not yet arrived" has entered fewer steps than the furthest one: it is stuck on the
host (a hung read, a deadlock, a stall in Python). When every process has entered the same step
and none finishes it, the stall is on the devices or in a collective: all are named, and all
write their stacks. The thread runs beside the main one, which may be blocked in the device
runtime, so it covers device-side stalls on every platform (CPU, GPU, TPU) as well; it does
not cover the time before the first step finishes (compilation), nor a process whose Python
threads are all frozen (SIGSTOP: the coordination service's heartbeat ends the others, and the
restart policy the run).

A compile is not a slow step: the seconds the loop's thread spends compiling (a new outer-step
program, the first evaluation; jaxdist.metrics.compiles) are not counted as waiting, and while
the loop evaluates (`between_steps`) no step is slow (the hang timeout still runs).
"""

import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time

import jax
from rich.console import Console

from jaxdist.cluster.join import ENDED, client
from jaxdist.cluster.restarts import HANG_EXIT
from jaxdist.metrics.compiles import Clock

_PREFIX = "jaxdist/progress/"
_HOSTS = "jaxdist/host/"
HANG_FLOOR_S = 600.0  # the default timeout's floor: a slow save or eval is not a hang
HANG_FACTOR = 20.0  # the default timeout, in p50 steps


def hang_limit(timeout: float | None, p50: float | None) -> float | None:
    """Seconds without a finished step after which the run is hung (None: not armed yet)."""
    if timeout == 0:
        return None
    if timeout is not None:
        return timeout
    return max(HANG_FLOOR_S, HANG_FACTOR * p50) if p50 else None


class Watchdog:
    def __init__(
        self,
        console: Console,
        factor: float = 10.0,
        min_seconds: float = 5.0,
        poll_s: float = 0.5,
        hang_timeout: float | None = None,
        on_hang=None,
    ):
        self.console, self.factor, self.min_seconds, self.poll_s = (
            console,
            factor,
            min_seconds,
            poll_s,
        )
        self.hang_timeout = hang_timeout
        self.on_hang = on_hang  # called before exiting, e.g. to flush the metrics log
        self.multi = jax.process_count() > 1
        self.last_step, self.last_time = -1, time.monotonic()
        self.entered = -1
        self.p50: float | None = None
        self._compiles = Clock()  # the loop's thread's (it makes the watchdog)
        self._compiled_at = self._compiles.total()  # when the last step finished
        self._between = False  # the loop is between steps (an evaluation)
        self._stop = threading.Event()
        self._reported_for = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="jaxdist-watchdog")
        if self.multi:
            me = jax.process_index()
            client().key_value_set(f"{_HOSTS}{me}", socket.gethostname(), allow_overwrite=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def finished(self, step: int, p50: float | None) -> None:
        self.last_step, self.last_time, self.p50 = step, time.monotonic(), p50
        self._compiled_at = self._compiles.total()
        if self.multi:
            client().key_value_set(
                f"{_PREFIX}{jax.process_index()}", f"{step}:{self.entered}", allow_overwrite=True
            )

    def enter(self, step: int) -> None:
        """Step `step` is being dispatched (posted with the next finished step)."""
        self.entered = step

    def alive(self) -> None:
        """Work between steps (a save, an evaluation) finished: not a stall."""
        self.last_time = time.monotonic()
        self._compiled_at = self._compiles.total()

    @contextlib.contextmanager
    def between_steps(self):
        """The loop works between steps (an evaluation): no step is slow meanwhile."""
        self._between = True
        try:
            yield
        finally:
            self._between = False
            self.alive()

    def waited(self) -> float:
        """Seconds since the last finished step (or work between steps), compiles not
        counted."""
        compiling = self._compiles.total() - self._compiled_at
        return max(0.0, time.monotonic() - self.last_time - compiling)

    def progress(self) -> dict[int, tuple[int, int]]:
        """Every process's (last finished, entered) step, as posted; (-1, -1) if none yet."""
        if not self.multi:
            return {0: (self.last_step, self.entered)}
        posted = {}
        for k, v in client().key_value_dir_get(_PREFIX):
            done, _, entered = v.partition(":")
            posted[int(k.rsplit("/", 1)[1])] = (int(done), int(entered or -1))
        return {p: posted.get(p, (-1, -1)) for p in range(jax.process_count())}

    def behind(self) -> dict[int, int]:
        """Processes not yet arrived at the furthest step entered: their last finished step."""
        if not self.multi:
            return {}
        posted = self.progress()
        top = max(e for _, e in posted.values())
        return {p: done for p, (done, entered) in posted.items() if entered < top}

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = self.waited()
            hang = hang_limit(self.hang_timeout, self.p50)
            self._follow(self._told(), waited, hang)  # another process ended the run: go too
            if self.last_step < 0:  # compiling: no step finished yet in this attempt
                continue
            if hang is not None and waited > hang:
                self._declare_hang(waited, hang)
            if self.p50 is None or self._reported_for == self.last_step or self._between:
                continue
            limit = max(self.factor * self.p50, self.min_seconds)
            if waited > limit:
                self._reported_for = self.last_step
                self.console.print(
                    self._slow_line(waited, hang), style="yellow", markup=False, highlight=False
                )

    def _slow_line(self, waited: float, hang: float | None) -> str:
        """The slow-step warning, as a person reads it: how long, against what, what the
        threshold is and which flag sets it, who is behind (several processes), what next."""
        line = (
            f"slow step {self.last_step + 1}: {waited:.1f} s so far, against a median step of "
            f"{self.p50:.3g} s (warned past {self.factor:g} x the median and at least "
            f"{self.min_seconds:g} s, --slow-step-factor; compile time is not counted)"
        )
        if self.multi:
            line += f"; not yet arrived: {_names(self._behind_or_none())}"
        if hang is not None:
            line += f"; no step finished in {hang:.0f} s is a hang (--hang-timeout)"
        return line

    def _behind_or_none(self) -> dict[int, int] | None:
        try:
            return self.behind()
        except Exception:  # noqa: BLE001 - the service may be the thing that is down
            return None

    def _told(self) -> dict[str, str]:
        """What other processes posted on ending the run: a hang, or an error they stop on."""
        if not self.multi:
            return {}
        try:
            return {k.rsplit("/", 1)[1]: v for k, v in client().key_value_dir_get(ENDED)}
        except Exception:  # noqa: BLE001 - the service may be down: the own timeout still runs
            return {}

    def _follow(self, told: dict[str, str], waited: float, hang: float | None) -> None:
        if "hang" in told:
            self._declare_hang(waited, hang or 0.0, told["hang"])
        stopped = sorted(k for k in told if k.startswith("stopped-"))
        if stopped:
            who = stopped[0].removeprefix("stopped-")
            os.write(
                2,
                f"\njaxdist: process {who} ended the run ({told[stopped[0]]}); this process "
                "ends too (exit 1)\n".encode(),
            )
            if self.on_hang is not None:
                _bounded(self.on_hang, 5.0)
            os._exit(1)

    def _declare_hang(self, waited: float, limit: float, told: str | None = None) -> None:
        """Names the stuck processes, dumps this one's stacks if it is one, and exits; the
        first to declare posts its finding, and the others exit with the same line."""
        me = jax.process_index()
        if told is None:
            stuck, line = self._finding(waited, limit)
            if self.multi:
                value = f"{','.join(map(str, stuck or ()))}|{line}"
                try:
                    client().key_value_set(f"{ENDED}hang", value, allow_overwrite=False)
                except Exception:  # noqa: BLE001 - another process declared first: its stands
                    told = self._told().get("hang")
        if told is not None:
            names, _, line = told.partition("|")
            stuck = {int(p): -1 for p in names.split(",") if p} or None
        os.write(2, f"\n{line}\n".encode())
        if stuck is None or me in stuck:
            os.write(2, f"jaxdist: process {me}'s Python stacks, where it is stuck:\n".encode())
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.on_hang is not None:
            _bounded(self.on_hang, 5.0)
        if self.multi and (me == 0 or told is None):
            # Process 0 serves the key-value store, and the first to declare closes the
            # collectives' connections when it exits: both wait for the others to read it.
            time.sleep(3.0)
        os._exit(HANG_EXIT)

    def _finding(self, waited: float, limit: float) -> tuple[dict[int, int] | None, str]:
        """The stuck processes (None: all, inside the same step) and the line that says so."""
        if not self.multi:
            stuck = {0: self.last_step}
        else:
            # None: nobody is behind (or the service does not say): all are inside the step.
            stuck = self._behind_or_none() or None
        hosts = _hosts() if self.multi else {0: socket.gethostname()}
        if stuck is None:
            who = (
                f"every process is inside step {self.last_step + 1} (a device or collective stall)"
            )
        else:
            who = "stuck: " + ", ".join(
                f"process {p} on {hosts.get(p, '?')} (last finished step {s})"
                for p, s in sorted(stuck.items())
            )
        line = (
            f"jaxdist: hang declared: no step finished for {waited:.0f} s (--hang-timeout "
            f"{limit:g} s); {who}. Exiting {HANG_EXIT}; a relaunch resumes from the newest "
            "checkpoint"
        )
        return stuck, line


def _bounded(fn, seconds: float) -> None:
    """Calls fn in a thread, waiting for it at most `seconds` (it may block on a stuck lock)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)


def _hosts() -> dict[int, str]:
    try:
        return {int(k.rsplit("/", 1)[1]): v for k, v in client().key_value_dir_get(_HOSTS)}
    except Exception:  # noqa: BLE001 - the service may be down: hosts stay unnamed
        return {}


def _names(behind: dict[int, int] | None) -> str:
    if behind is None:
        return "unknown (the coordination service does not answer)"
    return (
        ", ".join(f"process {p} (at step {s})" for p, s in sorted(behind.items()))
        or "none, every process is inside this step (waiting on the devices or a collective)"
    )
