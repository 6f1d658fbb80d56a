"""The optimizer: AdamW with linear warmup, cosine decay and global-norm gradient clipping."""

import dataclasses

import jax
import optax
from flax import nnx

from jaxdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    decay_steps: int = 0  # 0: decay over the whole run (set from --steps)
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.1
    clip_norm: float = 1.0

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
        logical = var.get_metadata().get("logical_axes", ())
        return var.replace(sum(1 for a in logical if a != "layers") >= 2)

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
