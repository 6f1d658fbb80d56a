"""Preemption: SIGTERM or SIGINT saves at the next step boundary and exits 0, in every
process of a run; a stuck boundary ends the process after a grace period (stage 5)."""

import os
import signal
import sys
import threading
from collections.abc import Callable

import jax

from jaxdist.cluster.join import client
from jaxdist.cluster.restarts import GRACE_EXIT


class PreemptionSignal:
    """SIGTERM or SIGINT asks the loop to save at the next step boundary and exit 0, in every
    process of the run.

    With several processes, every one must stop at the same step or the rest hang in the next
    collective. The process that got the signal proposes step s + 2 (s: the step it is at) in
    the coordination service's key-value store; the first proposal stands, and every process
    reads it at each step boundary. s + 2 is late enough for all: a process can be at most one
    step ahead of another (its step s + 1 cannot finish before the other dispatched s + 1,
    which it does after proposing), so none has passed s + 2 unaware. JAX's own preemption
    notices (a platform's maintenance event) are honoured too.

    If the boundary is not reached within `grace_s` of the first signal (a stuck step, a hang),
    the process exits GRACE_EXIT (143) without saving: the newest committed checkpoint stands.

    A second SIGINT (an impatient Ctrl-C) calls `end_now`, which ends the process at once,
    without that save (jaxdist.checkpoint.abandon: one line, exit 130, the unfinished save's
    directory removed). In an interactive session (IPython, Jupyter, python -i), where ending
    the process would end the session, it raises KeyboardInterrupt instead.
    """

    def __init__(
        self,
        end_now: Callable[[], None] | None = None,
        grace_s: float = 60.0,
        newest: Callable[[], str] = lambda: "the newest committed checkpoint",
    ):
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._multi = jax.process_count() > 1
        self._end_now = end_now
        self._grace_s, self._newest = grace_s, newest
        self._agreed: int | None = None
        self._timer: threading.Timer | None = None
        self._count = 0  # signals received
        self._asked = False  # a signal to this process asked for the save
        self._wakeup: tuple[int, int, int] | None = None  # read fd, write fd, the previous fd

    def _handle(self, signum, frame):
        # Runs in the main thread, and only once it returns to Python: a main thread blocked
        # in a stuck collective never does. So the signal is acted on by _listen, woken by
        # the byte Python's C-level handler writes at once (signal.set_wakeup_fd); here only
        # what must happen in the main thread: an interactive session's KeyboardInterrupt.
        if self._count > 1 and signum == signal.SIGINT and _interactive():
            raise KeyboardInterrupt

    def _listen(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self._act(signum)

    def _act(self, signum: int) -> None:
        self._count += 1
        if self._asked and signum == signal.SIGINT:
            if self._end_now is None or _interactive():
                return  # _handle raises KeyboardInterrupt in the main thread
            self._end_now()  # does not return
        if self._asked:  # a signal already asked for the save; its deadline stands
            return
        self._asked = True
        self.received = signal.Signals(signum).name
        # Said at once: the save waits for the step in flight, and a user who sees nothing
        # happen presses Ctrl-C again. os.write, not print: this may interrupt a print.
        again = "; Ctrl-C again stops at once, without it" if signum == signal.SIGINT else ""
        os.write(
            2,
            f"\n{self.received} received: stopping after this step's checkpoint{again}\n".encode(),
        )
        if self._grace_s > 0:
            self._timer = threading.Timer(self._grace_s, self._grace_expired)
            self._timer.daemon = True
            self._timer.start()

    def _grace_expired(self) -> None:
        os.write(
            2,
            f"\njaxdist: {self.received} received {self._grace_s:g} s ago and the step boundary "
            f"to save at was not reached (a stuck step?); exiting {GRACE_EXIT} without saving; "
            f"{self._newest()} stands (--term-grace sets the wait)\n".encode(),
        )
        os._exit(GRACE_EXIT)

    def stop_at(self, step: int) -> bool:
        """Whether to save and exit after this step (called by every process, every step)."""
        if not self._multi:
            return self.received is not None
        if self._agreed is None:
            self._agreed = self._agreement(step)
        return self._agreed is not None and step >= self._agreed

    def _agreement(self, step: int) -> int | None:
        """The step every process stops at, once one of them proposed it (see the class)."""
        from jax.experimental import multihost_utils

        if multihost_utils.reached_preemption_sync_point(step):
            self.received = self.received or "SIGTERM"
            return step
        store = client()
        found = store.key_value_dir_get(_STOP)
        if not found and self.received is not None:
            try:
                proposal = f"{step + 2}:{self.received}:{jax.process_index()}"
                store.key_value_set(f"{_STOP}at", proposal, allow_overwrite=False)
            except Exception:  # noqa: BLE001 - another process proposed first: its step stands
                pass
            found = store.key_value_dir_get(_STOP)
        if not found:
            return None
        at, name, by = found[0][1].split(":")
        if self.received is None:
            self.received = f"{name} (to process {by})"
        return int(at)

    def __enter__(self) -> "PreemptionSignal":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: the caller's policy stands
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._wakeup = (read_fd, write_fd, previous)
        threading.Thread(
            target=self._listen, args=(read_fd,), daemon=True, name="jaxdist-signals"
        ).start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:  # the save was reached and committed: no deadline left
            self._timer.cancel()
        for sig, handler in self._previous.items():
            # None: the handler was installed outside Python (JAX's preemption notifier).
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if self._wakeup is not None:
            read_fd, write_fd, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write_fd)  # the listener reads the end and returns
            self._wakeup = None


_STOP = "jaxdist/stop/"


def _interactive() -> bool:
    return hasattr(sys, "ps1") or sys.flags.interactive or "ipykernel" in sys.modules
