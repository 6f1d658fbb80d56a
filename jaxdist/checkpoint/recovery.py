"""Recovery policies of the loop: preemption signals and the non-finite-step policies."""

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

NonFinitePolicy = Literal["skip", "rollback", "stop"]


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (a non-finite step under policy `stop`); the message says why.

    The CLI prints it as one line and exits 1; every checkpoint already committed stays.
    """


class PreemptionSignal:
    """SIGTERM or SIGINT asks the loop to save at the next step boundary and exit cleanly.

    With several processes, every one must stop at the same step or the rest hang in the next
    collective; JAX's preemption service (started by jax.distributed.initialize) spreads a
    SIGTERM notice to all processes and picks one safe step for all, so there it decides.

    A second SIGINT (an impatient Ctrl-C) calls `end_now`, which ends the process at once,
    without that save (jaxdist.checkpoint.abandon: one line, exit 130, the unfinished save's
    directory removed). In an interactive session (IPython, Jupyter, python -i), where ending
    the process would end the session, it raises KeyboardInterrupt instead.
    """

    def __init__(self, end_now: Callable[[], None] | None = None):
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._multi = jax.process_count() > 1
        self._end_now = end_now

    def _handle(self, signum, frame):
        if self.received and signum == signal.SIGINT:
            if self._end_now is None or _interactive():
                raise KeyboardInterrupt
            self._end_now()  # does not return
        self.received = signal.Signals(signum).name
        # Said at once: the save waits for the step in flight, and a user who sees nothing
        # happen presses Ctrl-C again. os.write, not print: this may interrupt a print.
        again = "; Ctrl-C again stops at once, without it" if signum == signal.SIGINT else ""
        os.write(
            2,
            f"\n{self.received} received: stopping after this step's checkpoint{again}\n".encode(),
        )

    def stop_at(self, step: int) -> bool:
        """Whether to save and exit after this step (called by every process, every step)."""
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.received = "SIGTERM"
                return True
            return False
        return self.received is not None

    def __enter__(self) -> "PreemptionSignal":
        if not self._multi and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _interactive() -> bool:
    return hasattr(sys, "ps1") or sys.flags.interactive or "ipykernel" in sys.modules


def skipped_batches(first: int, bad: int) -> str:
    """The batches a rollback to a state at data position `first` (batches consumed) passes
    over when step `bad` went non-finite: `first`..`bad`, the bad one included. The restored
    checkpoint may be step `bad`'s own (saved with its update already skipped: `first` is
    then bad + 1), which skips only the bad batch."""
    if first >= bad:
        return f"batch {bad}"
    return f"batches {first}..{bad}"


def apply_nonfinite_policy(
    policy: str,
    s: int,
    checkpointer,
    jitted,
    shapes: dict,
    console,
):
    """Applies the non-finite policy to step s, whose update the step itself already skipped.

    Returns the state to continue from for `rollback`, None to go on as before.
    """
    if policy == "stop":
        checkpointer.close()
        raise TrainingStopped(
            f"step {s}: loss or gradient is NaN/Inf and --nonfinite stop was given; the last "
            f"good checkpoint ({checkpointer.steps()[-1] if checkpointer.steps() else 'none'}) "
            "is kept. Lower --lr, or use --nonfinite skip|rollback"
        )
    if policy == "skip":
        console.print(f"[yellow]step {s}: loss or gradient is NaN/Inf; update skipped[/]")
        return None
    checkpointer.wait()
    restored = checkpointer.restore_latest(jitted.abstract_state, shapes)
    if restored is None:
        console.print(
            f"[yellow]step {s}: NaN/Inf and no checkpoint to roll back to; update skipped[/]"
        )
        return None
    own = f" (saved with step {s}'s update skipped)" if restored.step == s else ""
    console.print(
        f"[yellow]step {s}: NaN/Inf; rolled back to checkpoint step {restored.step}{own}, "
        f"skipping {skipped_batches(int(restored.state.step), s)}[/]",
        soft_wrap=True,
    )
    step = jax.device_put(jnp.int32(s + 1), jitted.state_sharding.step)
    return restored.state._replace(step=step)
