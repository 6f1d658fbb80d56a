"""Recovery policies of the loop: preemption signals and non-finite steps."""

import signal
import threading
from typing import Literal

NonFinitePolicy = Literal["skip", "rollback", "stop"]


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (a non-finite step under policy `stop`); the message says why.

    The CLI prints it as one line and exits 1; every checkpoint already committed stays.
    """


class PreemptionSignal:
    """SIGTERM or SIGINT asks the loop to save at the next step boundary and exit cleanly.

    A second SIGINT falls through to Python's default (KeyboardInterrupt), for impatient users.
    """

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "PreemptionSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
