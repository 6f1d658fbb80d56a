"""The optimizer: AdamW with linear warmup, cosine decay and global-norm gradient clipping."""

import dataclasses
from typing import Annotated

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
    decay_steps: int = 0
    """cosine decay length; 0: the whole run"""
    min_lr_ratio: float = 0.1
    """the learning rate decays to this share of its peak"""
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.1
    """decoupled weight decay, on weight matrices only"""
    clip_norm: float = 1.0
    """global gradient norm clipped to this"""

    def validate(self) -> None:
        if self.learning_rate <= 0:
            raise ConfigError(f"learning rate {self.learning_rate} must be > 0")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ConfigError("warmup and decay steps must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio {self.min_lr_ratio} must lie in [0, 1]")


def schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    decay = config.decay_steps or total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(decay, config.warmup_steps + 1),
        end_value=config.learning_rate * config.min_lr_ratio,
    )


def make_optimizer(
    config: OptimConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The transformation and its learning-rate schedule (reported per step)."""
    config.validate()
    lr = schedule(config, total_steps)
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            lr,
            b1=config.b1,
            b2=config.b2,
            weight_decay=config.weight_decay,
            mask=_decay_mask,
        ),
    ), lr


def _decay_mask(params):
    """Decay weight matrices only: norms, biases and other vectors stay undecayed."""

    def one(var):
        return var.replace(sum(1 for a in logical_axes(var) if a != "layers") >= 2)

    return jax.tree.map(one, params, is_leaf=is_variable)
