"""Aux-loss-free load balancing (DeepSeek-V3, arXiv:2412.19437): a router's per-expert bias,
moved each step outside the gradient.

A model routes with `scores + bias` to choose experts and weighs them by the scores alone, so
no gradient reaches the bias. It holds the bias as an `ExpertBias`, a parameter that carries its
update rate and that its loss never differentiates: the optimizer's update of it is zero (no
decay either: it has one axis besides `layers`, jaxdist.optim). After the optimizer the step
moves it, layer by layer and expert by expert, by `rate * sign(mean load - load)`: an expert
chosen more than the mean goes down, one chosen less goes up. The loads are the step's own
(every microbatch's, the whole batch's: summed over devices before the step sees them), so
every device and every mesh moves it alike. Being a parameter, it is checkpointed, restored,
gathered for export and evaluated with the rest of the weights.

The model hands the loads in its aux as `expert_load`: {parameter name: load [L, E]}.
"""

import jax
import jax.numpy as jnp
from flax import nnx


class ExpertBias(nnx.Param):
    """A router's selection bias [L, E]; metadata `rate`: the step's move per step (0: none)."""


def moved(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
    """The bias after one step: each expert's moved by `rate` towards its layer's mean load."""
    mean_L1 = jnp.mean(load_LE, axis=-1, keepdims=True)
    return bias_LE + rate * jnp.sign(mean_L1 - load_LE).astype(bias_LE.dtype)


def rates(abstract_params: nnx.State) -> dict[str, float]:
    """{parameter name: rate} of the model's moving biases (a rate of 0 moves nothing)."""
    return {
        path[0]: v.get_metadata().get("rate", 0.0)
        for path, v in nnx.to_flat_state(abstract_params)
        if isinstance(v, ExpertBias) and v.get_metadata().get("rate", 0.0)
    }


def move(params: nnx.State, old: nnx.State, loads: dict, rates: dict, keep) -> nnx.State:
    """`params` (the optimizer's output) with each moving bias set to its old value moved by
    the step's loads; `keep(new, old)`: the step's choice between them (a skipped step keeps
    the old)."""
    for name, rate in rates.items():
        bias = old[name][...]
        params[name] = params[name].replace(keep(moved(bias, loads[name], rate), bias))
    return params
