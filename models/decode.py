"""The transformer of models/transformer.py run with a KV cache, for generation.

Legend: as models/transformer.py, and S cache length (key positions), T the tokens given in
this call (the whole prompt at prefill, 1 per decode step), starting at position `pos`.

`forward` computes exactly the layer of transformer._block (same weights, norms, RoPE, biases)
for T new tokens, attending to the cache, which it extends by their keys and values. The cache
is laid out by logical axes like every activation: rows over the batch axes, kv groups over the
tensor axis.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxdist.errors import ConfigError
from jaxdist.inference.generate import Decoder
from jaxdist.rules import constrain
from models.transformer import LOGICAL, TransformerConfig, after_attention, logits, qkv

CACHE_LOGICAL = {
    "k_LBSGH": ("layers", "batch", None, "kv_heads", "head_dim"),
    "v_LBSGH": ("layers", "batch", None, "kv_heads", "head_dim"),
}


def check(c: TransformerConfig) -> None:
    if c.num_experts and c.moe_impl != "dense":
        # Dispatch's capacity is sized for training batches: one token's experts could overflow
        # it. Dense runs every expert; decoding reads all their weights either way.
        raise ConfigError("generation with mixture-of-experts layers needs moe_impl dense")


def generating(c: TransformerConfig, compute_dtype: str) -> TransformerConfig:
    """`c` as generation computes it: in `compute_dtype`, MoE layers dense (every token reaches
    its experts, as in transformers)."""
    moe_impl = "dense" if c.num_experts else c.moe_impl
    return dataclasses.replace(c, compute_dtype=compute_dtype, moe_impl=moe_impl)


def decoder(c: TransformerConfig) -> Decoder:
    """The model as jaxdist.inference's Decoder."""
    check(c)
    return Decoder(
        forward=lambda p, t, cache, pos: forward(c, p, t, cache, pos),
        init_cache=lambda rows, length: init_cache(c, rows, length),
        cache_logical=CACHE_LOGICAL,
        context=c.seq_len,
    )


def init_cache(c: TransformerConfig, batch: int, length: int) -> dict[str, jax.Array]:
    shape = (c.num_layers, batch, length, c.num_kv_heads, c.head_dim)
    dtype = jnp.dtype(c.compute_dtype)
    return {name: jnp.zeros(shape, dtype) for name in CACHE_LOGICAL}


def forward(c: TransformerConfig, p: dict, tokens_BT: jax.Array, cache: dict, pos: jax.Array):
    """Logits [B, T, V] of T tokens at positions pos..pos+T-1, and the cache holding them."""
    dtype = jnp.dtype(c.compute_dtype)
    T = tokens_BT.shape[1]
    positions_T = pos + jnp.arange(T)
    x_BTD = jnp.take(p["tok_embed_VD"].astype(dtype), tokens_BT, axis=0)
    if c.style == "gpt2":
        pos_TD = jax.lax.dynamic_slice_in_dim(p["pos_embed_TD"].astype(dtype), pos, T)
        x_BTD = x_BTD + pos_TD
    x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
    layers = {k: v.astype(dtype) for k, v in p.items() if "_L" in k}
    S = cache["k_LBSGH"].shape[2]
    # Query t sees keys up to its own position; later cache rows (still zeros) are masked.
    mask_11TS = (jnp.arange(S)[None, :] <= positions_T[:, None])[None, None]

    def block(x_BTD, layer):
        w, k_BSGH, v_BSGH = layer
        w = {k: constrain(v, LOGICAL[k][1:]) for k, v in w.items()}
        x_BTD, k_BSGH, v_BSGH = _block(
            c, x_BTD, w, positions_T[None], mask_11TS, k_BSGH, v_BSGH, pos
        )
        return x_BTD, (k_BSGH, v_BSGH)

    x_BTD, (k_LBSGH, v_LBSGH) = jax.lax.scan(
        block, x_BTD, (layers, cache["k_LBSGH"], cache["v_LBSGH"])
    )
    return logits(c, p, x_BTD), {"k_LBSGH": k_LBSGH, "v_LBSGH": v_LBSGH}


def _block(c, x_BTD, w, positions_1T, mask_11TS, k_BSGH, v_BSGH, pos):
    """transformer's layer itself, its attention over the cache extended by these tokens."""
    q_BTNH, k_BTGH, v_BTGH = qkv(c, x_BTD, w, positions_1T)
    k_BSGH = jax.lax.dynamic_update_slice_in_dim(k_BSGH, k_BTGH.astype(k_BSGH.dtype), pos, 1)
    v_BSGH = jax.lax.dynamic_update_slice_in_dim(v_BSGH, v_BTGH.astype(v_BSGH.dtype), pos, 1)
    attn_BTNH = jax.nn.dot_product_attention(
        q_BTNH, k_BSGH, v_BSGH, mask=mask_11TS, implementation="xla"
    )
    x_BTD, _ = after_attention(c, x_BTD, attn_BTNH, w)
    return x_BTD, k_BSGH, v_BSGH
