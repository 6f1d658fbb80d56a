"""Mixture-of-experts MLP: a top-k router (models/routing.py) over SwiGLU experts, and the
shared expert some models add for every token (DeepSeek's n_shared_experts, Qwen2-MoE's, which a
sigmoid of the token gates).

Legend: B batch  T seq  D embed  F mlp (per expert)  E expert  K router choices  L layers

Two implementations of one function: `dispatch` sends tokens to their experts through
jaxdist.parallel.experts (over the `expert` mesh axis; dropless, or per-expert capacity);
`dense` runs every expert on every token and masks by the router: the reference a test
compares against.
"""

import jax
import jax.numpy as jnp

from jaxdist.parallel.experts import moe_ffn
from jaxdist.rules import batch_mean, constrain
from models import routing

MOE_LOGICAL = {
    # The router is small and every device routes its own tokens: replicated over experts.
    "router_LDE": ("layers", "embed", None),
    "w_up_LEDF": ("layers", "expert", "embed", "mlp"),
    "w_gate_LEDF": ("layers", "expert", "embed", "mlp"),
    "w_down_LEFD": ("layers", "expert", "mlp", "embed"),
    # The selection bias (aux-loss-free balancing): per layer and expert, beside the router.
    "expert_bias_LE": ("layers", None),
    # The shared expert: a dense SwiGLU laid out as the dense MLP's, and Qwen2-MoE's gate.
    "shared_w_up_LDF": ("layers", "embed", "mlp"),
    "shared_w_gate_LDF": ("layers", "embed", "mlp"),
    "shared_w_down_LFD": ("layers", "mlp", "embed"),
    "shared_gate_LD1": ("layers", "embed", None),
}


def moe_mlp(c, h_BTD, w) -> tuple[jax.Array, dict]:
    """One MoE layer; returns its output and per-layer statistics and auxiliary losses."""
    E, K = c.num_experts, c.top_k
    # The router in fp32: its scores decide where every token goes.
    logits_BTE = jnp.einsum(
        "btd,de->bte", h_BTD.astype(jnp.float32), w["router_LDE"].astype(jnp.float32)
    )
    probs_BTE, expert_BTK, weight_BTK = routing.route(c, logits_BTE, w.get("expert_bias_LE"))
    chosen_BTE = jnp.sum(jax.nn.one_hot(expert_BTK, E), axis=2)
    # Load balancing (Switch Transformer, over top-k assignments): E * sum_e f_e * p_e, with
    # f and p means over the whole batch, wherever its rows are.
    balance = E * jnp.sum(batch_mean(chosen_BTE, (0, 1)) / K * batch_mean(probs_BTE, (0, 1)))
    z_loss = batch_mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)), (0, 1))
    if c.moe_impl == "dense":
        gate_BTEF = jnp.einsum("btd,edf->btef", h_BTD, w["w_gate_LEDF"])
        up_BTEF = jnp.einsum("btd,edf->btef", h_BTD, w["w_up_LEDF"])
        out_BTED = jnp.einsum("btef,efd->bted", jax.nn.silu(gate_BTEF) * up_BTEF, w["w_down_LEFD"])
        mix_BTE = jnp.sum(jax.nn.one_hot(expert_BTK, E) * weight_BTK[..., None], axis=2)
        y_BTD = jnp.einsum("bted,bte->btd", out_BTED, mix_BTE.astype(out_BTED.dtype))
        stats = {
            "dropped": jnp.float32(0),
            "assigned": jnp.float32(expert_BTK.size),
            "load_E": jnp.sum(chosen_BTE, (0, 1)),
        }
    else:
        y_BTD, stats = moe_ffn(
            h_BTD,
            expert_BTK,
            weight_BTK.astype(h_BTD.dtype),
            w["w_up_LEDF"],
            w["w_gate_LEDF"],
            w["w_down_LEFD"],
            c.capacity_factor,
            c.moe_buffer_factor,
            c.moe_gemm,
        )
    if c.shared_width:
        y_BTD = y_BTD + shared_expert(c, h_BTD, w)
    return y_BTD, {**stats, "balance_loss": balance, "z_loss": z_loss}


def shared_expert(c, h_BTD, w) -> jax.Array:
    """The shared expert's output for every token: a SwiGLU, gated by a sigmoid of the token
    where the model has the gate (Qwen2-MoE)."""
    gate_BTF = jnp.einsum("btd,df->btf", h_BTD, w["shared_w_gate_LDF"])
    up_BTF = jnp.einsum("btd,df->btf", h_BTD, w["shared_w_up_LDF"])
    up_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, ("batch", "seq", "mlp"))
    y_BTD = jnp.einsum("btf,fd->btd", up_BTF, w["shared_w_down_LFD"])
    if c.shared_expert_gate:
        gate_BT1 = jax.nn.sigmoid(jnp.einsum("btd,do->bto", h_BTD, w["shared_gate_LD1"]))
        y_BTD = y_BTD * gate_BT1
    return y_BTD


def summarize(c, aux: dict) -> dict:
    """Layer-stacked statistics -> the auxiliary loss and the step's MoE metrics."""
    load_LE = aux["load_E"] / jnp.mean(aux["load_E"], axis=-1, keepdims=True)
    # The loads the step moves the selection bias by (jaxdist.optim), summed over the
    # whole batch: the same on every device and every mesh.
    moved = {"expert_bias_LE": aux["load_E"]} if c.bias_update_rate else {}
    return {
        "expert_load": moved,
        "loss": c.balance_coef * jnp.mean(aux["balance_loss"])
        + c.z_loss_coef * jnp.mean(aux["z_loss"]),
        "metrics": {
            "moe_dropped": jnp.sum(aux["dropped"]) / jnp.sum(aux["assigned"]),
            "moe_load_min": jnp.min(load_LE),
            "moe_load_max": jnp.max(load_LE),
            "moe_balance_loss": jnp.mean(aux["balance_loss"]),
            "moe_z_loss": jnp.mean(aux["z_loss"]),
        },
    }
