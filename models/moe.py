"""Mixture-of-experts MLP (Mixtral-style): a top-k router over SwiGLU experts.

Legend: B batch  T seq  D embed  F mlp (per expert)  E expert  K router choices  L layers

Two implementations of one function: `dispatch` sends tokens to their experts through
jaxdist.parallel.experts (over the `expert` mesh axis; dropless, or per-expert capacity);
`dense` runs every expert on every token and masks by the router: the reference a test
compares against.
"""

import jax
import jax.numpy as jnp

from jaxdist.parallel.experts import moe_ffn
from jaxdist.rules import batch_mean

MOE_LOGICAL = {
    # The router is small and every device routes its own tokens: replicated over experts.
    "router_LDE": ("layers", "embed", None),
    "w_up_LEDF": ("layers", "expert", "embed", "mlp"),
    "w_gate_LEDF": ("layers", "expert", "embed", "mlp"),
    "w_down_LEFD": ("layers", "expert", "mlp", "embed"),
}


def moe_mlp(c, h_BTD, w) -> tuple[jax.Array, dict]:
    """One MoE layer; returns its output and per-layer statistics and auxiliary losses."""
    E, K = c.num_experts, c.top_k
    # The router in fp32: its softmax decides where every token goes.
    logits_BTE = jnp.einsum(
        "btd,de->bte", h_BTD.astype(jnp.float32), w["router_LDE"].astype(jnp.float32)
    )
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    top_BTK, expert_BTK = _top_k(logits_BTE, K)
    if c.moe_renormalize:  # Mixtral: softmax over all, top-k, renormalised = softmax of top-k
        weight_BTK = jax.nn.softmax(top_BTK, axis=-1)
    else:  # Qwen-MoE without norm_topk_prob: the chosen experts' probabilities as they are
        weight_BTK = jnp.take_along_axis(probs_BTE, expert_BTK, axis=-1)
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
        )
    return y_BTD, {**stats, "balance_loss": balance, "z_loss": z_loss}


def _top_k(logits_BTE, K):
    """lax.top_k by K rounds of argmax: XLA partitions argmax along the batch, while its
    TopK custom call gathers the whole batch onto every device first."""
    vals, idxs = [], []
    masked = logits_BTE
    for _ in range(K):
        i_BT = jnp.argmax(masked, axis=-1)
        vals.append(jnp.take_along_axis(masked, i_BT[..., None], axis=-1)[..., 0])
        idxs.append(i_BT)
        masked = jnp.where(jax.nn.one_hot(i_BT, masked.shape[-1], dtype=bool), -jnp.inf, masked)
    return jnp.stack(vals, -1), jnp.stack(idxs, -1).astype(jnp.int32)


def summarize(c, aux: dict) -> dict:
    """Layer-stacked statistics -> the auxiliary loss and the step's MoE metrics."""
    load_LE = aux["load_E"] / jnp.mean(aux["load_E"], axis=-1, keepdims=True)
    return {
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
