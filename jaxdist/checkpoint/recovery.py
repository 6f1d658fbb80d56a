"""Recovery policies of the loop for non-finite steps (signals: jaxdist.checkpoint.preemption)."""

import jax
import jax.numpy as jnp

from jaxdist.errors import TrainingStopped


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
