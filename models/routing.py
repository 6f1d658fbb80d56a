"""The MoE router: which experts each token goes to, and with what weights.

Legend: B batch  T seq  D embed  E expert  K router choices  G expert groups

Two families (models/transformer_config.py's `scoring`):
- softmax (Mixtral, Qwen2/3-MoE): probabilities over all experts, the top k of them, their
  weights renormalized or as they are (`moe_renormalize`, HF's norm_topk_prob);
- sigmoid (DeepSeek-V3): an independent score per expert; the choice is the top k of the
  scores plus a per-expert bias (`expert_bias_LE`, HF's e_score_correction_bias), the weights
  the chosen scores without it, renormalized, times `routed_scaling_factor`.
Either may be group-limited (`n_group`, `topk_group`): experts are cut into groups, a group
scores the sum of its best two experts, and a token chooses only among its best groups'.
The bias moves the choice and never a weight, and no gradient reaches it: the step moves it
from the experts' loads (jaxdist.optim).
"""

import jax
import jax.numpy as jnp


def route(c, logits_BTE: jax.Array, bias_E: jax.Array | None = None):
    """(probabilities for the balance loss [B, T, E], chosen experts [B, T, K] int32, their
    weights [B, T, K]) from the router's fp32 logits."""
    K = c.top_k
    if c.scoring == "softmax" and c.n_group <= 1 and bias_E is None:
        # Mixtral's and Qwen's path, as it always ran: top-k of the logits is top-k of the
        # probabilities, and a softmax of the top logits is their renormalized probabilities.
        probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
        top_BTK, expert_BTK = top_k(logits_BTE, K)
        if c.moe_renormalize:
            weight_BTK = jax.nn.softmax(top_BTK, axis=-1)
        else:
            weight_BTK = jnp.take_along_axis(probs_BTE, expert_BTK, axis=-1)
        return probs_BTE, expert_BTK, _scaled(c, weight_BTK)
    if c.scoring == "softmax":
        scores_BTE = jax.nn.softmax(logits_BTE, axis=-1)
        probs_BTE = scores_BTE
    else:
        scores_BTE = jax.nn.sigmoid(logits_BTE)
        # The balance loss's "probabilities": each token's scores normalized over the experts
        # (DeepSeek-V3's sequence-wise loss does the same).
        probs_BTE = scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True)
    choice_BTE = scores_BTE
    if bias_E is not None:
        choice_BTE = scores_BTE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    if c.n_group > 1:
        choice_BTE = group_limited(choice_BTE, c.n_group, c.topk_group)
    _, expert_BTK = top_k(choice_BTE, K)
    weight_BTK = jnp.take_along_axis(scores_BTE, expert_BTK, axis=-1)
    if c.moe_renormalize:
        # HF's 1e-20: sigmoid scores may all be tiny; the sum never divides by zero.
        weight_BTK = weight_BTK / (jnp.sum(weight_BTK, axis=-1, keepdims=True) + 1e-20)
    return probs_BTE, expert_BTK, _scaled(c, weight_BTK)


def _scaled(c, weight_BTK):
    # DeepSeek-V3's routed_scaling_factor; 1 leaves the program as it was.
    if c.routed_scaling_factor == 1.0:
        return weight_BTK
    return weight_BTK * c.routed_scaling_factor


def group_limited(choice_BTE: jax.Array, groups: int, keep: int) -> jax.Array:
    """The choice scores with every expert outside the token's best `keep` of `groups` groups
    set to -inf; a group's score is the sum of its two best experts' (DeepSeek-V3)."""
    B, T, E = choice_BTE.shape
    grouped_BTGE = choice_BTE.reshape(B, T, groups, E // groups)
    best2_BTG2, _ = top_k(grouped_BTGE, min(2, E // groups))
    group_BTG = jnp.sum(best2_BTG2, axis=-1)
    _, kept_BTk = top_k(group_BTG, keep)
    mask_BTG = jnp.sum(jax.nn.one_hot(kept_BTk, groups, dtype=jnp.int32), axis=-2) > 0
    mask_BTE = jnp.repeat(mask_BTG, E // groups, axis=-1)
    return jnp.where(mask_BTE, choice_BTE, -jnp.inf)


def top_k(x, K):
    """lax.top_k by K rounds of argmax over the last axis: XLA partitions argmax along the
    batch, while its TopK custom call gathers the whole batch onto every device first."""
    vals, idxs = [], []
    masked = x
    for _ in range(K):
        i = jnp.argmax(masked, axis=-1)
        vals.append(jnp.take_along_axis(masked, i[..., None], axis=-1)[..., 0])
        idxs.append(i)
        masked = jnp.where(jax.nn.one_hot(i, masked.shape[-1], dtype=bool), -jnp.inf, masked)
    return jnp.stack(vals, -1), jnp.stack(idxs, -1).astype(jnp.int32)
