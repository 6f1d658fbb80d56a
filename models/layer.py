"""One transformer layer's math, shared by training (models/transformer.py, which runs the layers
stacked) and generation (models/decode.py, one token at a time from its cache): the norms,
RoPE, the attention projections (qkv, or latent attention's through models/mla.py) and the rest
of the layer after attention (output projection, residual, dense MLP or MoE).

The attention and dense MLP projections are einsums through jaxdist.kernels.fp8 (`project`):
in the compute dtype, or in FP8 where the step's --fp8 runs them so.
"""

import functools

import jax
import jax.numpy as jnp

from jaxdist.kernels import fp8
from jaxdist.rules import constrain
from models import mla, moe, remat, rope
from models.transformer_config import TransformerConfig

# The projections that may run in FP8: each weight's einsum with its input (one layer's).
PROJECTIONS = {
    "wqkv_LDGQH": "btd,dgqh->btgqh",
    "wo_LNHD": "btnh,nhd->btd",
    "w_up_LDF": "btd,df->btf",
    "w_gate_LDF": "btd,df->btf",
    "w_down_LFD": "btf,fd->btd",
}


def norm(c: TransformerConfig, x_BTD, scale_D, bias_D):
    """RMSNorm (Llama) or LayerNorm (GPT-2: the mean taken out first), with its scale and bias."""
    # Statistics in fp32 whatever the compute dtype: bf16 variance loses too many bits.
    x32 = x_BTD.astype(jnp.float32)
    if c.style == "gpt2":
        x32 = x32 - x32.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(x32), -1, keepdims=True)
    y = (x32 * jax.lax.rsqrt(var + c.norm_eps)).astype(x_BTD.dtype) * scale_D
    return y if bias_D is None else y + bias_D


def apply_rope(c: TransformerConfig, x_BTNH, positions_BT):
    """Rotary positions; positions_BT per token ([1, T] broadcasts over the batch)."""
    freqs_H2 = jnp.asarray(rope.inv_freq(c.rope_theta, c.rope_scaling, x_BTNH.shape[-1]))
    angles_BTH2 = positions_BT[..., None].astype(jnp.float32) * freqs_H2
    sin, cos = jnp.sin(angles_BTH2)[:, :, None, :], jnp.cos(angles_BTH2)[:, :, None, :]
    scale = rope.attention_scale(c.rope_scaling)
    if scale != 1.0:  # yarn: cos and sin scaled, so attention logits by scale**2
        sin, cos = sin * scale, cos * scale
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def project(x, w: dict, name: str) -> jax.Array:
    """x through the layer's weight `name` (its einsum in PROJECTIONS): in FP8 where the
    step's --fp8 runs this projection so, else in the compute dtype."""
    return fp8.einsum(PROJECTIONS[name], x, w[name], fp8.layer_meta(w, name))


def qkv(c: TransformerConfig, x_BTD, w, positions_BT):
    """A layer's queries [B, T, N, H], keys and values [B, T, G, H] (RoPE applied, Llama)
    from its input; models/decode.py shares it with the training layer. Latent attention:
    queries [B, T, N, U], keys [B, T, N, U], values [B, T, N, W] (models/mla.py)."""
    if c.mla:
        q_BTNU, c_BTC, kr_BTP = latent(c, x_BTD, w, positions_BT)
        return q_BTNU, *mla.expand(c, w, c_BTC, kr_BTP)
    B, T, _ = x_BTD.shape
    h_BTD = norm(c, x_BTD, w["norm1_scale_LD"], w.get("norm1_bias_LD"))
    qkv_BTGQH = project(h_BTD, w, "wqkv_LDGQH")
    qkv_BTGQH = remat.checkpoint_name(qkv_BTGQH, remat.QKV_PROJ)
    if c.attention_bias:
        qkv_BTGQH = qkv_BTGQH + w["bias_qkv_LGQH"]
    qkv_BTGQH = constrain(qkv_BTGQH, ("batch", "seq", "kv_heads", "qkv", "head_dim"))
    q_per_group = c.num_heads // c.num_kv_heads
    # Head n of the query is head n % (N/G) of group n // (N/G), as jax's GQA expects.
    q_BTNH = qkv_BTGQH[:, :, :, :q_per_group].reshape(B, T, c.num_heads, c.head_dim)
    k_BTGH = qkv_BTGQH[:, :, :, q_per_group]
    v_BTGH = qkv_BTGQH[:, :, :, q_per_group + 1]
    if c.qk_norm:
        q_BTNH = norm(c, q_BTNH, w["q_norm_scale_LH"], None)
        k_BTGH = norm(c, k_BTGH, w["k_norm_scale_LH"], None)
    if c.style == "llama":
        q_BTNH, k_BTGH = apply_rope(c, q_BTNH, positions_BT), apply_rope(c, k_BTGH, positions_BT)
    return q_BTNH, k_BTGH, v_BTGH


def latent(c: TransformerConfig, x_BTD, w, positions_BT):
    """Latent attention's queries [B, T, N, U], latent [B, T, C] and RoPE key [B, T, P] of a
    layer's input (models/mla.py); generation caches the latter two."""
    h_BTD = norm(c, x_BTD, w["norm1_scale_LD"], w.get("norm1_bias_LD"))
    return mla.latent(c, h_BTD, w, positions_BT, functools.partial(apply_rope, c))


def after_attention(c: TransformerConfig, x_BTD, attn_BTNH, w):
    """The rest of the layer from its attention output: output projection, residual, MLP (or
    MoE); returns the layer's output and its MoE statistics ({} for a dense MLP)."""
    attn_BTNH = constrain(attn_BTNH, ("batch", "seq", "heads", "head_dim"))
    out_BTD = project(attn_BTNH, w, "wo_LNHD")
    out_BTD = remat.checkpoint_name(out_BTD, remat.OUT_PROJ)
    if c.out_bias:
        out_BTD = out_BTD + w["bias_o_LD"]
    x_BTD = x_BTD + constrain(out_BTD, ("batch", "seq", "embed"))

    h_BTD = norm(c, x_BTD, w["norm2_scale_LD"], w.get("norm2_bias_LD"))
    if c.num_experts:
        y_BTD, aux = moe.moe_mlp(c, h_BTD, w)
        return x_BTD + constrain(y_BTD, ("batch", "seq", "embed")), aux
    up_BTF = project(h_BTD, w, "w_up_LDF") + w.get("bias_up_LF", 0)
    if c.style == "llama":
        gate_BTF = project(h_BTD, w, "w_gate_LDF") + w.get("bias_gate_LF", 0)
        up_BTF = jax.nn.silu(gate_BTF) * up_BTF
    else:
        up_BTF = jax.nn.gelu(up_BTF, approximate=True)
    up_BTF = constrain(up_BTF, ("batch", "seq", "mlp"))
    down_BTD = project(up_BTF, w, "w_down_LFD") + w.get("bias_down_LD", 0)
    return x_BTD + constrain(down_BTD, ("batch", "seq", "embed")), {}
