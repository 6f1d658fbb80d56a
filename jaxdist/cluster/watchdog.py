"""Slow-step watchdog: a step far slower than usual is reported, with the processes that have
not finished the step before it (the stragglers every collective is waiting for).

Each process posts its last finished step to the coordination service's key-value store (one
small RPC per step on the host, never touching the device); a background thread compares the
time since the last finished step with `factor` x the p50 step time.
"""

import threading
import time

import jax
from rich.console import Console

_PREFIX = "jaxdist/progress/"


def _client():
    from jax._src import distributed

    return distributed.global_state.client


class Watchdog:
    def __init__(
        self, console: Console, factor: float = 10.0, min_seconds: float = 5.0, poll_s: float = 0.5
    ):
        self.console, self.factor, self.min_seconds, self.poll_s = (
            console,
            factor,
            min_seconds,
            poll_s,
        )
        self.multi = jax.process_count() > 1
        self.last_step, self.last_time = -1, time.monotonic()
        self.p50: float | None = None
        self._stop = threading.Event()
        self._reported_for = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="jaxdist-watchdog")

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def finished(self, step: int, p50: float | None) -> None:
        self.last_step, self.last_time, self.p50 = step, time.monotonic(), p50
        if self.multi:
            _client().key_value_set(
                f"{_PREFIX}{jax.process_index()}", str(step), allow_overwrite=True
            )

    def behind(self) -> dict[int, int]:
        """Processes whose last finished step is behind the furthest one."""
        if not self.multi:
            return {}
        posted = {int(k.rsplit("/", 1)[1]): int(v) for k, v in _client().key_value_dir_get(_PREFIX)}
        top = max(posted.values(), default=-1)
        missing = {p: -1 for p in range(jax.process_count()) if p not in posted}
        return {**{p: s for p, s in posted.items() if s < top}, **missing}

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.p50 is None or self._reported_for == self.last_step:
                continue
            waited = time.monotonic() - self.last_time
            limit = max(self.factor * self.p50, self.min_seconds)
            if waited > limit:
                self._reported_for = self.last_step
                try:
                    behind = self.behind()
                except Exception:  # noqa: BLE001 - the service may be the thing that is down
                    behind = {}
                who = (
                    ", ".join(f"process {p} (at step {s})" for p, s in sorted(behind.items()))
                    or "none behind: all processes are inside the same step"
                )
                self.console.print(
                    f"[yellow]slow step {self.last_step + 1}: {waited:.1f} s so far, over "
                    f"{self.factor:g} x p50 ({limit:.1f} s); not yet arrived: {who}[/]"
                )
