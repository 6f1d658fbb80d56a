"""When the groups of a `replica` mesh axis meet (jaxdist.parallel.replica): their settings
(`SyncConfig`, recorded as a run's `sync`) and, for each step, the fragments whose round it ends
or whose new weights it applies (`action`): the schedule the loop and the step read, and what
`plan` prices.
"""

from typing import NamedTuple

from jaxdist.layout import SyncConfig


class Action(NamedTuple):
    """What a step does beside its inner step (static: each distinct action compiles once)."""

    send: tuple[int, ...] = ()
    """fragments whose exchange and outer update run in this step"""
    apply: tuple[int, ...] = ()
    """fragments whose new weights the groups take at the end of this step"""
    after: bool = False
    """the exchange reads the weights after this step's update (no delay), not its input"""


def action(sync: SyncConfig, step: int) -> Action | None:
    """What step `step` (0-based) does beside its inner step; None: nothing."""
    H, F, T = sync.sync_every, sync.sync_fragments, sync.sync_delay
    turn = H // F

    def ends(s: int) -> tuple[int, ...]:  # fragments whose round ends after step s
        # Fragment f's rounds end f turns after fragment 0's would: after steps f*turn - 1,
        # f*turn - 1 + H, ... (fragment 0's first after step H - 1).
        later = [s + 1 - f * turn for f in range(F)]
        return tuple(f for f in range(F) if s >= 0 and later[f] >= 0 and later[f] % H == 0)

    if T == 0:
        due = ends(step)
        return Action(due, due, after=True) if due else None
    send, apply = ends(step - 1), ends(step - T)
    return Action(send, apply) if send or apply else None
