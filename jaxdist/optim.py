"""The optimizer: AdamW with linear warmup, then cosine, linear or constant, and global-norm
gradient clipping."""

import dataclasses
from typing import Annotated, Literal

import jax
import optax
import tyro

from jaxdist.errors import ConfigError
from jaxdist.rules import is_variable, logical_axes


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    # The aliases are the command line's short names (jaxdist.cli reads these dataclasses).
    learning_rate: Annotated[float, tyro.conf.arg(aliases=("--lr",))] = 3e-3
    """peak learning rate, reached after the warmup"""
    warmup_steps: int = 20
    """steps of linear warmup from zero to the peak learning rate"""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """the learning rate's shape after the warmup"""
    decay_steps: int = 0
    """decay length; 0: the whole run"""
    min_lr_ratio: float = 0.1
    """the learning rate decays to this share of its peak"""
    b1: float = 0.9
    """AdamW's first-moment decay"""
    b2: float = 0.95
    """AdamW's second-moment decay"""
    eps: float = 1e-8
    """Adam's epsilon"""
    weight_decay: float = 0.1
    """decoupled weight decay, on weight matrices only"""
    clip_norm: Annotated[float, tyro.conf.arg(aliases=("--clip",))] = 1.0
    """global gradient norm clipped to this; 0: no clipping"""

    def validate(self) -> None:
        if not self.learning_rate > 0:
            raise ConfigError(f"--lr {self.learning_rate} must be > 0")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ConfigError(
                f"--warmup-steps {self.warmup_steps} and --decay-steps {self.decay_steps} "
                "must be >= 0"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min-lr-ratio {self.min_lr_ratio} must lie in [0, 1]")
        for name, b in (("b1", self.b1), ("b2", self.b2)):
            if not 0 <= b < 1:
                raise ConfigError(f"--{name} {b} must lie in [0, 1) (Adam's moment decay)")
        if not self.eps > 0:
            raise ConfigError(f"--eps {self.eps} must be > 0 (it keeps Adam's division finite)")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay {self.weight_decay} must be >= 0")
        if self.clip_norm < 0:
            raise ConfigError(f"--clip {self.clip_norm} must be >= 0 (0: no clipping)")


def schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    peak, end = config.learning_rate, config.learning_rate * config.min_lr_ratio
    warmup = config.warmup_steps
    decay = max(config.decay_steps or total_steps, warmup + 1)
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, decay, end)
    after = (
        optax.linear_schedule(peak, end, decay - warmup)
        if config.schedule == "linear"
        else optax.constant_schedule(peak)
    )
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_optimizer(
    config: OptimConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The transformation and its learning-rate schedule (reported per step)."""
    config.validate()
    lr = schedule(config, total_steps)
    clip = optax.clip_by_global_norm(config.clip_norm) if config.clip_norm else optax.identity()
    return optax.chain(
        clip,
        optax.adamw(
            lr,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=_decay_mask,
        ),
    ), lr


def _decay_mask(params):
    """Decay weight matrices only: norms, biases and other vectors stay undecayed."""

    def one(var):
        return var.replace(sum(1 for a in logical_axes(var) if a != "layers") >= 2)

    return jax.tree.map(one, params, is_leaf=is_variable)
