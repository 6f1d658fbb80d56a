"""When to checkpoint: a fixed step interval, or Young-Daly from measured save cost and MTBF.

Young-Daly: the interval that minimises (checkpoint cost + expected lost work) is
tau = sqrt(2 * C * M) (Daly's higher-order form below), with C the time the loop is blocked per
save and M the system's mean time between failures. M falls as the fleet grows (M_device / N),
so the interval shrinks with it; C is measured, save by save, so the interval adapts.

Two terms are traded: save overhead (C per interval) and work lost to an interruption (half an
interval on average). Young-Daly balances them for failures at the MTBF, but a run is also
stopped by what the MTBF does not count (a kill, a preempted node, an out-of-memory), and a
small run's MTBF is years: its tau would leave hours unsaved. So auto caps the interval at
`auto_cap_minutes` of training, paying in overhead only while that stays under
`CAP_OVERHEAD` (1%); past that, Young-Daly's interval is kept (a big fleet's long interval is
not shortened into heavy overhead). No save is made only to learn its cost (a step-0 save paid
the save's one-off setup while the loop waited): until a cost is known, the first save waits
for a cap's worth of steps at the measured step time, or an MTBF's if shorter (Daly's interval
never exceeds the MTBF, whatever the cost).
"""

import dataclasses
import math
import statistics
from typing import Annotated

import numpy as np
import tyro

from jaxdist.errors import ConfigError

# Llama 3 (arXiv:2407.21783): 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. one
# per ~3.1 h for the job and ~50,700 hours per GPU.
DEFAULT_MTBF_HOURS_PER_DEVICE = 50_000.0
# The most save overhead the cap may add to shorten Young-Daly's interval: above it, losing
# more work on an interruption is the cheaper side.
CAP_OVERHEAD = 0.01


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    # The aliases are the command line's names (jaxdist.cli reads these dataclasses).
    every: Annotated[str, tyro.conf.arg(aliases=("--checkpoint-every",))] = "auto"
    """steps between checkpoints, or auto: Young-Daly's interval, sqrt(2 x save cost x MTBF),
    which loses the least time to saves and recomputed steps together, from the measured save
    cost and the devices' MTBF (mean time between failures), at most --checkpoint-cap-minutes
    apart; the final step is always saved"""
    keep: Annotated[int, tyro.conf.arg(aliases=("--checkpoint-keep",))] = 3
    """newest checkpoints kept; older ones are deleted once a newer one commits"""
    mtbf_hours_per_device: Annotated[float, tyro.conf.arg(aliases=("--mtbf-hours-per-device",))] = (
        DEFAULT_MTBF_HOURS_PER_DEVICE
    )
    """one device's MTBF, mean time between failures, in hours (a run's is this over its device
    count), for the auto interval (Llama 3 saw ~50,700 GPU-hours per interruption)"""
    auto_cap_minutes: Annotated[float, tyro.conf.arg(aliases=("--checkpoint-cap-minutes",))] = 10.0
    """minutes of training at most between auto checkpoints, while saving that often costs <1%"""
    allow_fresh_start: Annotated[bool, tyro.conf.arg(prefix_name=False)] = False
    """restart at step 0 if no checkpoint restores (they stay)"""
    local_dir: Annotated[str | None, tyro.conf.arg(aliases=("--local-checkpoint-dir",))] = None
    """node-local directory (tmpfs, local disk) for a fast second tier: each process saves its
    own shards there; a restore takes the newest good checkpoint of both tiers"""
    local_every: Annotated[str, tyro.conf.arg(aliases=("--local-checkpoint-every",))] = "auto"
    """steps between local checkpoints, or auto: Young-Daly's interval (see
    --checkpoint-every) from their measured cost"""
    local_loss_share: Annotated[float, tyro.conf.arg(aliases=("--local-loss-share",))] = 0.78
    """share of failures that lose a node's local tier (a host replaced), which only the
    persistent tier survives; it sets the persistent interval when there is a local tier
    (Llama 3: 78% of interruptions were hardware)"""

    def fixed_steps(self, every: str | None = None, flag: str = "--checkpoint-every") -> int | None:
        every = self.every if every is None else every
        if every == "auto":
            return None
        try:
            n = int(every)
        except ValueError:
            raise ConfigError(f"{flag} {every!r} is neither a step count nor 'auto'") from None
        if n < 1:
            raise ConfigError(f"{flag} {n} must be at least 1 (or 'auto')")
        return n

    def validate(self) -> None:
        self.fixed_steps()
        self.fixed_steps(self.local_every, "--local-checkpoint-every")
        if self.local_every != "auto" and self.local_dir is None:
            raise ConfigError("--local-checkpoint-every needs --local-checkpoint-dir DIR")
        if not 0 < self.local_loss_share <= 1:
            raise ConfigError(f"--local-loss-share {self.local_loss_share} must lie in (0, 1]")
        if self.keep < 1:
            raise ConfigError(f"--checkpoint-keep {self.keep} must be at least 1")
        if self.mtbf_hours_per_device <= 0:
            raise ConfigError(f"--mtbf-hours-per-device {self.mtbf_hours_per_device} must be > 0")
        if self.auto_cap_minutes <= 0:
            raise ConfigError(f"--checkpoint-cap-minutes {self.auto_cap_minutes} must be > 0")


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum of the compute time between checkpoints."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


class Interval:
    """Decides, step by step, whether to save; refines itself from each measured save.

    Auto passes through two phases: before any save cost is known, `steps` is the first save's
    wait, min(cap, MTBF) in steps at the measured step time (None until a step is timed: no
    save is due); once one is known, it is the interval `interval_s` chooses. `choose` sets
    both."""

    def __init__(self, config: CheckpointConfig, num_devices: int, tier: str = "persistent"):
        """tier "local": the node-local tier (every failure but a lost node is restored from
        it); "persistent" with a local tier beside it guards only against the failures that
        lose it, so its MTBF is the system's over `local_loss_share`."""
        config.validate()
        local = tier == "local"
        self.fixed = config.fixed_steps(config.local_every if local else None)
        self.mtbf_s = config.mtbf_hours_per_device * 3600 / num_devices
        if not local and config.local_dir is not None:
            self.mtbf_s /= config.local_loss_share
        self.cap_s = config.auto_cap_minutes * 60
        self.blocked_s: list[float] = []
        self.steps = self.fixed
        self.priced = False  # auto: `steps` comes from a measured save cost
        self.last_saved: int | None = None

    def resume(self, step: int, records: list[dict], tier: str) -> None:
        """A resumed attempt: the last save is the restored step, and the save costs are those
        the run's earlier attempts logged for this tier (metrics.jsonl's save events)."""
        self.last_saved = step
        logged = [
            r["blocked_s"]
            for r in records
            if r.get("event") == "save" and r.get("tier", "persistent") == tier
        ]
        self.blocked_s = logged[-16:]

    def pending(self) -> bool:
        """Auto, and `choose` has more to say: no interval yet, or one from before a save cost
        was known while one now is (a resumed attempt's logged costs)."""
        return self.fixed is None and (
            self.steps is None or (bool(self.blocked_s) and not self.priced)
        )

    def due(self, step: int) -> bool:
        if self.steps is None:  # auto before any step is timed: nothing to price a save by
            return False
        return step - (self.last_saved if self.last_saved is not None else -1) >= self.steps

    def observe(self, step: int, blocked_s: float, step_time_s: float | None) -> dict | None:
        """Records a save; for auto, recomputes the interval and returns its inputs to log."""
        self.last_saved = step
        self.blocked_s.append(blocked_s)
        return self.choose(step_time_s)

    def interval_s(self, cost_s: float) -> tuple[float, float]:
        """(the interval chosen, Young-Daly's) in seconds for a save that blocks `cost_s`:
        min(tau, max(cap, cost / CAP_OVERHEAD)). tau minimises overhead plus work lost to
        failures at the MTBF; the cap shortens it, paying overhead for restartability against
        what the MTBF does not count, but only down to where that overhead reaches 1%."""
        tau = daly_interval_s(cost_s, self.mtbf_s)
        return min(tau, max(self.cap_s, cost_s / CAP_OVERHEAD)), tau

    def choose(self, step_time_s: float | None) -> dict | None:
        """For auto, once a step time is known: the interval in steps, and, once a save cost
        is known too, its inputs, to log (None before: a cap's worth of steps is not a choice
        of Young-Daly's and has nothing measured to report)."""
        if self.fixed is not None or not step_time_s:
            return None
        if not self.blocked_s:
            _, step_time_s = _agreed(0.0, step_time_s)
            first_s = min(self.cap_s, self.mtbf_s)  # the longest any cost could make tau
            self.steps = max(1, math.ceil(first_s / step_time_s))
            return None
        # The first save also pays one-off setup (threads, directories): use the later ones.
        cost = statistics.median(self.blocked_s[1:] or self.blocked_s)
        cost, step_time_s = _agreed(cost, step_time_s)
        chosen, tau = self.interval_s(cost)
        self.steps, self.priced = max(1, round(chosen / step_time_s)), True
        return {
            "interval_steps": self.steps,
            "interval_s": chosen,
            "young_daly_s": tau,
            "cap_s": self.cap_s,
            "save_blocked_s": cost,
            "mtbf_system_s": self.mtbf_s,
            "step_time_s": step_time_s,
            "expected_overhead": cost / (chosen + cost),
        }


def worth_saying(chosen: dict, step: int, steps: int) -> bool:
    """Whether an interval chosen after `step` (Interval.choose's) changes what the run does:
    a save it makes falls before the run's last step (which is always saved). One longer than
    what is left of the run is logged (metrics.jsonl), not printed."""
    return step + chosen["interval_steps"] < steps - 1


def _agreed(cost_s: float, step_time_s: float) -> tuple[float, float]:
    """Process 0's measurements, in every process: each measures its own, and a save is a
    collective that all must start at the same step, so all must choose the same interval.
    (Every process calls this at the same steps: their saves and their step counts agree.)"""
    import jax

    if jax.process_count() == 1:
        return cost_s, step_time_s
    from jax.experimental import multihost_utils

    both = multihost_utils.broadcast_one_to_all(np.array([cost_s, step_time_s], np.float64))
    return float(both[0]), float(both[1])
