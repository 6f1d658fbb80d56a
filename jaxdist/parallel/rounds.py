"""When the groups of a `replica` mesh axis meet (jaxdist.parallel.replica): their settings
(`SyncConfig`, recorded as a run's `sync`) and, for each step, the fragments whose round it ends
or whose new weights it applies (`action`): the schedule the loop and the step read, and what
`plan` prices.
"""

import dataclasses
from typing import Literal, NamedTuple, get_args

from jaxdist.errors import ConfigError

SyncDtype = Literal["float32", "bfloat16", "float8", "int8"]


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """How the groups of a `replica` mesh axis meet (DiLoCo, jaxdist.parallel.replica): each
    trains alone on its block of every batch, and every `sync_every` steps an outer Nesterov
    step moves the shared weights by the groups' mean change."""

    sync_every: int = 32
    """H: inner steps between two outer steps (of each fragment)"""
    outer_lr: float = 0.7
    """the outer Nesterov step's lr (DiLoCo's 0.7; short runs did best at 1, no momentum)"""
    outer_momentum: float = 0.9
    """the outer step's Nesterov momentum (torch.optim.SGD(nesterov=True)); 0: plain SGD"""
    sync_fragments: int = 1
    """F: the layers in F strided groups (layer l in group l % F), one synced every H/F steps
    in turn (Streaming DiLoCo); the other weights go with group 0"""
    sync_delay: int = 0
    """T: inner steps a fragment's exchange overlaps before it is applied (0: at once); the
    groups then mix the new weights with what they learnt meanwhile (--sync-mix)"""
    sync_mix: float = 0.5
    """with --sync-delay: the share of the outer weights in each group's new weights"""
    outer_memory: Literal["device", "host"] = "device"
    """where the outer state (weights and momentum) lives between outer steps: host memory
    frees the device of it, for a copy in and out at each outer step"""
    sync_dtype: SyncDtype = "float32"
    """the type the exchange travels in: float32 and bfloat16 send the weights, the 8-bit
    types the change since the last outer step with a float32 scale per row (each group then
    keeps the outer weights: 4 bytes a parameter more); summed in float32"""

    def changed_flags(self) -> list[str]:
        """The flags of the settings given other than their defaults (--sync-every, ...)."""
        return [
            "--" + f.name.replace("_", "-")
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]

    def validate(self, replicas: int, layers: int | None = None) -> None:
        H, F, T = self.sync_every, self.sync_fragments, self.sync_delay
        if H < 1:
            raise ConfigError(f"--sync-every {H} must be at least 1 (steps between outer steps)")
        if F < 1 or H % F:
            raise ConfigError(
                f"--sync-fragments {F} must divide --sync-every {H}: each fragment's turn is "
                "H/F steps"
            )
        if layers is not None and layers % F:
            raise ConfigError(
                f"--sync-fragments {F} does not divide the model's {layers} layers; use a "
                f"divisor of {layers}"
            )
        if not 0 <= T < H // F:
            raise ConfigError(
                f"--sync-delay {T} must be shorter than a fragment's turn (H/F = {H // F} "
                f"steps): 0 to {H // F - 1}"
            )
        if not 0 < self.outer_lr:
            raise ConfigError(f"--outer-lr {self.outer_lr} must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum {self.outer_momentum} must be in [0, 1)")
        if not 0 < self.sync_mix <= 1:
            raise ConfigError(f"--sync-mix {self.sync_mix} must be in (0, 1]")
        if self.sync_dtype not in get_args(SyncDtype):
            *most, last = get_args(SyncDtype)
            raise ConfigError(
                f"--sync-dtype {self.sync_dtype!r}: choose {', '.join(most)} or {last}"
            )
        if replicas < 1:
            raise ConfigError(f"replica={replicas} must be at least 1")


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
