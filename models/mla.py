"""Multi-head latent attention (DeepSeek-V2/V3), the attention of a config with kv_lora_rank > 0
(models/transformer_config.py), as transformers' DeepseekV3Attention computes it.

Legend: as models/transformer.py, and R q_lora_rank, C kv_lora_rank (the latent), P
qk_rope_head_dim (the RoPE part of q.k: one key shared by all heads), K qk_nope_head_dim, U = K + P
(a head's q.k width), W v_head_dim (a head's value, the H of wo_LNHD), A = C + P (what the kv
down-projection gives), X = K + W (a head's key part and value, up-projected from the latent).

    q_BTNU = W_uq RMSNorm(W_dq h)        (or W_q h without q_lora_rank), split into K | P
    c_BTC, kr_BTP = split(W_dkv h)       c normed, kr rotated: what generation caches
    k_BTNU = (W_uk c) || kr              kr broadcast over the heads
    v_BTNW = W_uv c

The queries' and keys' RoPE parts are rotated; with rope_interleave (DeepSeek's checkpoints)
their rotated pairs are adjacent columns, taken apart (evens, then odds) before the rotation as
transformers does, so q.k is transformers' to the bit. Where yarn's mscale_all_dim is set the
softmax scale is U^-0.5 times mscale squared: the queries carry the factor, since every kernel
scales by U^-0.5 itself.

Sharding (the weights' logical axes): the up-projections split by heads over `tensor`, as Q, K
and V do. The ranks R and C are an up-projection's input, which each head needs whole: never
split in the activations; stored, they take `embed`'s rules (split over fsdp, gathered per layer
like every weight) where the weight has no `embed` dim already. The down-projections' rank dims
are named `head_dim`, which no rule splits: replicated (each tensor-parallel device computes the
small latent itself rather than gathering it), and visible to the planner as matmuls.
"""

import jax
import jax.numpy as jnp

from jaxdist.rules import constrain
from models import remat, rope

MLA_LOGICAL = {
    "wq_LDNU": ("layers", "embed", "heads", "head_dim"),
    "wq_a_LDR": ("layers", "embed", "head_dim"),
    "q_a_norm_scale_LR": ("layers", "embed"),
    "wq_b_LRNU": ("layers", "embed", "heads", "head_dim"),
    "wkv_a_LDA": ("layers", "embed", "head_dim"),
    "kv_a_norm_scale_LC": ("layers", "embed"),
    "wkv_b_LCNX": ("layers", "embed", "heads", "head_dim"),
}
# transformers' q_a_layernorm and kv_a_layernorm keep RMSNorm's default epsilon, not the
# config's rms_norm_eps (DeepSeek's own code does the same).
LATENT_EPS = 1e-6
LATENT = ("batch", "seq", None)
HEADS = ("batch", "seq", "heads", "head_dim")


def latent(c, h_BTD, w: dict, positions_BT, rotate):
    """The queries [B, T, N, U] of a layer's normed input, its latent [B, T, C] and RoPE key
    [B, T, P]; `rotate(x_BTNP, positions_BT)` applies RoPE (models/transformer.py's)."""
    if c.q_lora_rank:
        q_BTR = _latent_norm(
            jnp.einsum("btd,dr->btr", h_BTD, w["wq_a_LDR"]), w["q_a_norm_scale_LR"]
        )
        q_BTNU = jnp.einsum("btr,rnu->btnu", constrain(q_BTR, LATENT), w["wq_b_LRNU"])
    else:
        q_BTNU = jnp.einsum("btd,dnu->btnu", h_BTD, w["wq_LDNU"])
    q_BTNU = constrain(remat.checkpoint_name(q_BTNU, remat.QKV_PROJ), HEADS)
    kv_BTA = jnp.einsum("btd,da->bta", h_BTD, w["wkv_a_LDA"])
    kv_BTA = constrain(remat.checkpoint_name(kv_BTA, remat.QKV_PROJ), LATENT)
    C, K = c.kv_lora_rank, c.qk_nope_head_dim
    c_BTC = _latent_norm(kv_BTA[..., :C], w["kv_a_norm_scale_LC"])
    kr_BT1P = _rotate(c, kv_BTA[:, :, None, C:], positions_BT, rotate)
    q_rope_BTNP = _rotate(c, q_BTNU[..., K:], positions_BT, rotate)
    q_BTNU = jnp.concatenate([q_BTNU[..., :K], q_rope_BTNP], axis=-1)
    scale = query_scale(c)
    if scale != 1.0:
        q_BTNU = q_BTNU * jnp.asarray(scale, q_BTNU.dtype)
    return q_BTNU, c_BTC, kr_BT1P[:, :, 0]


def expand(c, w: dict, c_BSC, kr_BSP):
    """Keys [B, S, N, U] and values [B, S, N, W] from the latent and the RoPE key."""
    kv_BSNX = jnp.einsum("bsc,cnx->bsnx", c_BSC, w["wkv_b_LCNX"])
    kv_BSNX = constrain(remat.checkpoint_name(kv_BSNX, remat.QKV_PROJ), HEADS)
    K = c.qk_nope_head_dim
    kr_BSNP = jnp.broadcast_to(kr_BSP[:, :, None], (*kv_BSNX.shape[:3], kr_BSP.shape[-1]))
    k_BSNU = jnp.concatenate([kv_BSNX[..., :K], kr_BSNP.astype(kv_BSNX.dtype)], axis=-1)
    return constrain(k_BSNU, HEADS), constrain(kv_BSNX[..., K:], HEADS)


def query_scale(c) -> float:
    """What the queries are multiplied by so that the kernels' U^-0.5 gives transformers'
    softmax scale: yarn_get_mscale(factor, mscale_all_dim) squared where a scaled RoPE sets
    mscale_all_dim (DeepSeek-V3's yarn), else 1."""
    s = dict(c.rope_scaling)
    m = s.get("mscale_all_dim")
    if s.get("rope_type", "default") == "default" or not m:
        return 1.0
    return rope.yarn_mscale(s["factor"], m) ** 2


def _rotate(c, x_BTNP, positions_BT, rotate):
    if c.rope_interleave:  # pairs (0, 1), (2, 3), ... to transformers' halves: evens, odds
        x_BTNP = jnp.concatenate([x_BTNP[..., 0::2], x_BTNP[..., 1::2]], axis=-1)
    return rotate(x_BTNP, positions_BT)


def _latent_norm(x_BTR, scale_R):
    # Statistics in fp32 whatever the compute dtype, as models/transformer.py's norms.
    x32 = x_BTR.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), -1, keepdims=True)
    return (x32 * jax.lax.rsqrt(var + LATENT_EPS)).astype(x_BTR.dtype) * scale_R
