"""The optimizer: AdamW, or Muon on the weight matrices and AdamW on the rest, with linear
warmup, then cosine, linear or constant, and global-norm gradient clipping.

Which weights Muon takes is read from each parameter's logical axes, never from its name: a
matrix is a weight with two or more dims besides the stacked `layers` and the `expert` axis
(batch dims of Muon: one orthogonalization per layer and per expert); a weight with a `vocab`
or `seq` axis is a lookup table or the head, and stays with AdamW, like norms and biases."""

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from jaxdist.config import OptimConfig
from jaxdist.parallel import muon
from jaxdist.rules import is_variable, logical_axes


def schedule(config: OptimConfig, total_steps: int, peak: float | None = None) -> optax.Schedule:
    """The learning rate per step, rising to `peak` (default: --lr) and decaying from it."""
    peak = config.learning_rate if peak is None else peak
    end = peak * config.min_lr_ratio
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
    """The transformation and its learning-rate schedule (reported per step: AdamW's)."""
    config.validate()
    lr = schedule(config, total_steps)
    clip = optax.clip_by_global_norm(config.clip_norm) if config.clip_norm else optax.identity()
    adamw = optax.adamw(
        lr,
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=_decay_mask,
    )
    if config.optimizer == "adamw":
        return optax.chain(clip, adamw), lr
    matrices = _muon(config, schedule(config, total_steps, config.muon_lr))
    return optax.chain(clip, optax.partition({"muon": matrices, "adamw": adamw}, muon_labels)), lr


def _decay_mask(params):
    """Decay weight matrices only: norms, biases and other vectors stay undecayed."""

    def one(var):
        return var.replace(sum(1 for a in logical_axes(var) if a != "layers") >= 2)

    return jax.tree.map(one, params, is_leaf=is_variable)


# --- Muon ----------------------------------------------------------------------------------

# Batch dims of Muon's matrices: every layer and every expert is orthogonalized on its own.
_BATCH_AXES = ("layers", "expert")
# Dims of lookup tables (token and position embeddings) and of the head: AdamW's.
_TABLE_AXES = ("vocab", "seq")


def muon_dims(axes: tuple[str | None, ...]) -> MuonDimensionNumbers | None:
    """The matrix a weight with these logical axes is to Muon (reduction dims, output dims of
    x @ W), or None where AdamW takes it: fewer than two dims besides the batch ones, or a
    table. The residual stream's `embed` is the input of a projection out of it (wqkv, w_up)
    and the output of one back into it (wo, w_down); without it the last dim is the output."""
    if any(a in _TABLE_AXES for a in axes):
        return None
    matrix = [i for i, a in enumerate(axes) if a not in _BATCH_AXES]
    if len(matrix) < 2:
        return None
    split = 1 if axes[matrix[0]] == "embed" else len(matrix) - 1
    return MuonDimensionNumbers(tuple(matrix[:split]), tuple(matrix[split:]))


def muon_labels(params):
    """Each parameter's optax.partition label, "muon" or "adamw", from its axes."""

    def one(var):
        return var.replace("adamw" if muon_dims(logical_axes(var)) is None else "muon")

    return jax.tree.map(one, params, is_leaf=is_variable)


def _muon(config: OptimConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    """optax.contrib.muon's update for its matrices: Nesterov momentum orthogonalized by
    Newton-Schulz (each matrix whole on one device: jaxdist.parallel.muon), scaled by
    sqrt(max(1, fan_out / fan_in)), decoupled weight decay."""
    return optax.chain(
        muon.scale_by_muon(muon_dims, config.muon_ns_steps, config.muon_beta, config.eps),
        muon.scale_by_shape(muon_dims),
        optax.add_decayed_weights(config.weight_decay),
        optax.scale_by_learning_rate(lr),
    )
