"""The optimizer: AdamW, or Muon on the weight matrices and AdamW on the rest, with linear
warmup, then cosine, linear or constant, and global-norm gradient clipping.

Which weights Muon takes is read from each parameter's logical axes, never from its name: a
matrix is a weight with two or more dims besides the stacked `layers` and the `expert` axis
(batch dims of Muon: one orthogonalization per layer and per expert); a weight with a `vocab`
or `seq` axis is a lookup table or the head, and stays with AdamW, like norms and biases.

One parameter no gradient moves: a router's balancing bias (`ExpertBias`, last below), which
the step moves after the optimizer by the experts' loads."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
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


# --- A parameter no gradient moves: the router's balancing bias ----------------------------
# Aux-loss-free load balancing (DeepSeek-V3, arXiv:2412.19437): a router's per-expert bias,
# moved each step outside the gradient.
#
# A model routes with `scores + bias` to choose experts and weighs them by the scores alone, so
# no gradient reaches the bias. It holds the bias as an `ExpertBias`, a parameter that carries its
# update rate and that its loss never differentiates: the optimizer's update of it is zero (no
# decay either: it has one axis besides `layers`, jaxdist.optim). After the optimizer the step
# moves it, layer by layer and expert by expert, by `rate * sign(mean load - load)`: an expert
# chosen more than the mean goes down, one chosen less goes up. The loads are the step's own
# (every microbatch's, the whole batch's: summed over devices before the step sees them), so
# every device and every mesh moves it alike. Being a parameter, it is checkpointed, restored,
# gathered for export and evaluated with the rest of the weights.
#
# The model hands the loads in its aux as `expert_load`: {parameter name: load [L, E]}.


class ExpertBias(nnx.Param):
    """A router's selection bias [L, E]; metadata `rate`: the step's move per step (0: none)."""


def moved(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
    """The bias after one step: each expert's moved by `rate` towards its layer's mean load."""
    mean_L1 = jnp.mean(load_LE, axis=-1, keepdims=True)
    return bias_LE + rate * jnp.sign(mean_L1 - load_LE).astype(bias_LE.dtype)


def bias_rates(abstract_params: nnx.State) -> dict[str, float]:
    """{parameter name: rate} of the model's moving biases (a rate of 0 moves nothing)."""
    return {
        path[0]: v.get_metadata().get("rate", 0.0)
        for path, v in nnx.to_flat_state(abstract_params)
        if isinstance(v, ExpertBias) and v.get_metadata().get("rate", 0.0)
    }


def move_biases(params: nnx.State, old: nnx.State, loads: dict, rates: dict, keep) -> nnx.State:
    """`params` (the optimizer's output) with each moving bias set to its old value moved by
    the step's loads; `keep(new, old)`: the step's choice between them (a skipped step keeps
    the old)."""
    for name, rate in rates.items():
        bias = old[name][...]
        params[name] = params[name].replace(keep(moved(bias, loads[name], rate), bias))
    return params
