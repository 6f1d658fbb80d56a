"""When the groups of a `replica` mesh axis meet (jaxdist.parallel.replica): their settings
(`SyncConfig`, recorded as a run's `sync`) and, for each step, the fragments whose round it ends
or whose new weights it applies (`action`): the schedule the loop and the step read, and what
`plan` prices. Also how large the outer step is where `--outer-lr auto` leaves it to the run
(`outer_choice`; `resolved` fills the SyncConfig with it).
"""

import dataclasses
from typing import NamedTuple

from jaxdist.layout import AUTO, SyncConfig

# Below this H, or with fewer syncs than this left in the run, `auto` is plain averaging.
TUNED_FROM_H = 30
TUNED_FROM_SYNCS = 100
AVERAGING = (1.0, 0.0)
TUNED = (0.7, 0.9)  # DiLoCo's outer lr and Nesterov momentum (arXiv:2311.08105)


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


class OuterStep(NamedTuple):
    """The outer step's lr and Nesterov momentum, and why (the run's header says it)."""

    lr: float
    momentum: float
    why: str


def outer_choice(H: int, steps_left: int | None, replicas: int) -> OuterStep:
    """`--outer-lr auto`: plain averaging (lr 1, momentum 0) for H below 30, a run with fewer
    than 100 syncs left, or one group; the published tuned step (0.7, Nesterov 0.9) otherwise.
    `steps_left` None (a compile, a comm report: no run's length): decided on H and M alone.

    Why: (0.7, 0.9) was tuned in DiLoCo at H = 500 over 128 outer steps from a pretrained start;
    nothing below H = 50 was tried. arXiv:2503.09799 finds the best outer lr rising with H and
    with M (about 0.4 at M = 1, 0.6 at M = 2, at H = 30), so a smaller H wants a smaller step
    than 0.7/0.9; arXiv:2509.10439 finds lr / (1 - momentum) is what counts (0.7/0.9 is 7,
    averaging 1) and saw averaging beat 0.7/0.9. Over few syncs the momentum has no time to
    average out the groups' noise: 0.7/0.9 moves the weights 3 to 6 times further than the
    groups did along a direction each sync repeats. Measured on tiny-llama, two groups, H = 8,
    200 steps: averaging +2.0% above data parallelism's eval loss and 0.4% from the best of a
    sweep of lr and momentum, 0.7/0.9 +23.7% (experiments/README.md, "The outer step for short
    runs"). With one group averaging is no outer step at all (the mean is its own weights),
    where the tuned one would extrapolate a single group's path."""
    if replicas < 2:
        return OuterStep(*AVERAGING, f"plain averaging, one group (M = {replicas})")
    if H < TUNED_FROM_H:
        return OuterStep(*AVERAGING, f"plain averaging, H = {H} is below {TUNED_FROM_H}")
    syncs = (
        None if steps_left is None else steps_left // H
    )  # H >= 30: a bad --sync-every 0 is for validate
    if syncs is not None and syncs < TUNED_FROM_SYNCS:
        return OuterStep(
            *AVERAGING, f"plain averaging, {syncs} syncs left, fewer than {TUNED_FROM_SYNCS}"
        )
    left = "" if syncs is None else f", {syncs} syncs left"
    return OuterStep(*TUNED, f"the tuned DiLoCo step, H = {H} >= {TUNED_FROM_H}{left}")


def resolved(
    sync: SyncConfig, steps_left: int | None, replicas: int, recorded: dict | None = None
) -> tuple[SyncConfig, str]:
    """`sync` with `auto` outer lr and momentum replaced, and the header's line saying which
    and why. `recorded`: the `sync` of the checkpoint a run resumes from, whose numbers an
    `auto` takes (that run resolved them at its start: a resume must not change them because
    --steps did); values given stay as given."""
    auto = [f for f in ("outer_lr", "outer_momentum") if getattr(sync, f) == AUTO]
    if not auto:
        why = "as given"
    elif recorded and all(isinstance(recorded.get(f), int | float) for f in auto):
        sync = dataclasses.replace(sync, **{f: float(recorded[f]) for f in auto})
        why = "as the run chose at its start, recorded in its checkpoint"
    else:
        choice = outer_choice(sync.sync_every, steps_left, replicas)
        chosen = {"outer_lr": choice.lr, "outer_momentum": choice.momentum}
        sync = dataclasses.replace(sync, **{f: chosen[f] for f in auto})
        why = choice.why
    if auto:
        which = "auto" if len(auto) == 2 else f"--{auto[0].replace('_', '-')} auto"
        why = f"{which}: {why}"
    return sync, f"outer step: lr {sync.outer_lr:g}, momentum {sync.outer_momentum:g} ({why})"


def outer_values(sync: SyncConfig, replicas: int) -> tuple[float, float]:
    """The outer step's (lr, momentum) the program compiles: as resolved, or where nothing
    resolved `auto` (a compile, a comm report), `outer_choice` without a run's length."""
    new = resolved(sync, None, replicas)[0]
    return float(new.outer_lr), float(new.outer_momentum)
