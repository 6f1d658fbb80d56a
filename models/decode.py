"""The transformer of models/transformer.py run with a KV cache, for generation.

Legend: as models/transformer.py, and S cache length (key positions), T the tokens given in
this call (the whole prompt at prefill, 1 per decode step), starting at position `pos`.

`forward` computes exactly the layer training runs (models/layer.py: the same weights, norms,
RoPE, biases) for T new tokens, attending to the cache, which it extends by their keys and
values. The cache is laid out by logical axes like every activation: rows over the batch axes,
kv groups over the tensor axis.

Latent attention (models/mla.py) caches what DeepSeek-V3's does, per layer and token: the normed
latent c [C] and the rotated RoPE key [P], not each head's keys and values (DeepSeek-V3: 576
numbers a token and layer against 128 x (192 + 128)). Each step rebuilds the keys and values of
the whole cache from them (W_uk c, W_uv c) rather than absorbing W_uk into the queries and W_uv
into the output: the same products in transformers' order, so its greedy choices are ours. The
latent has no head axis to split: it stays whole on each tensor-parallel device, which
up-projects its own heads.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxdist.errors import ConfigError
from jaxdist.inference.generate import Decoder
from jaxdist.parallel.attention import padded_values
from jaxdist.rules import constrain
from models import mla
from models.layer import after_attention, latent, qkv
from models.transformer import LOGICAL, TransformerConfig, logits, of_stack
from models.transformer_config import stacks

CACHE_LOGICAL = {
    "k_LBSGH": ("layers", "batch", None, "kv_heads", "head_dim"),
    "v_LBSGH": ("layers", "batch", None, "kv_heads", "head_dim"),
}
MLA_CACHE_LOGICAL = {
    "c_LBSC": ("layers", "batch", None, None),
    "kr_LBSP": ("layers", "batch", None, None),
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
        cache_logical={
            prefix + k: v
            for prefix, _ in stacks(c)
            for k, v in (MLA_CACHE_LOGICAL if c.mla else CACHE_LOGICAL).items()
        },
        context=c.seq_len,
    )


def init_cache(c: TransformerConfig, batch: int, length: int) -> dict[str, jax.Array]:
    """Each layer stack's cache (stacks), its entries named with the stack's prefix."""
    return {
        prefix + k: v
        for prefix, stack in stacks(c)
        for k, v in _stack_cache(stack, batch, length).items()
    }


def _stack_cache(c: TransformerConfig, batch: int, length: int) -> dict[str, jax.Array]:
    dtype = jnp.dtype(c.compute_dtype)
    if c.mla:
        L = c.num_layers
        return {
            "c_LBSC": jnp.zeros((L, batch, length, c.kv_lora_rank), dtype),
            "kr_LBSP": jnp.zeros((L, batch, length, c.qk_rope_head_dim), dtype),
        }
    shape = (c.num_layers, batch, length, c.num_kv_heads, c.head_dim)
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
    S = next(iter(cache.values())).shape[2]
    # Query t sees keys up to its own position; later cache rows (still zeros) are masked.
    mask_11TS = (jnp.arange(S)[None, :] <= positions_T[:, None])[None, None]

    def block(stack, x_BTD, layer):
        # One layer's weights and cache (each cache entry without its L axis).
        w, kv = layer
        w = {k: constrain(v, LOGICAL[k][1:]) for k, v in w.items()}
        return _block(stack, x_BTD, w, positions_T[None], mask_11TS, kv, pos)

    out = {}
    for prefix, stack in stacks(c):  # the dense first layers, then the rest
        step = functools.partial(block, stack)
        x_BTD, kv = jax.lax.scan(step, x_BTD, (of_stack(layers, prefix), of_stack(cache, prefix)))
        out |= {prefix + k: v for k, v in kv.items()}
    return logits(c, p, x_BTD), out


def _block(c, x_BTD, w, positions_1T, mask_11TS, kv: dict, pos):
    """transformer's layer itself, its attention over the cache extended by these tokens."""
    if c.mla:
        q_BTNH, c_BTC, kr_BTP = latent(c, x_BTD, w, positions_1T)
        kv = _extended(kv, {"c_LBSC": c_BTC, "kr_LBSP": kr_BTP}, pos)
        k_BSGH, v_BSGW = mla.expand(c, w, kv["c_LBSC"], kv["kr_LBSP"])
    else:
        q_BTNH, k_BTGH, v_BTGH = qkv(c, x_BTD, w, positions_1T)
        kv = _extended(kv, {"k_LBSGH": k_BTGH, "v_LBSGH": v_BTGH}, pos)
        k_BSGH, v_BSGW = kv["k_LBSGH"], kv["v_LBSGH"]
    W = v_BSGW.shape[-1]  # latent attention's values are narrower than q.k: padded, cut
    attn_BTNH = jax.nn.dot_product_attention(
        q_BTNH,
        k_BSGH,
        padded_values(v_BSGW, q_BTNH.shape[-1]),
        mask=mask_11TS,
        implementation="xla",
    )[..., :W]
    x_BTD, _ = after_attention(c, x_BTD, attn_BTNH, w)
    return x_BTD, kv


def _extended(kv: dict, new: dict, pos) -> dict:
    """The layer's cache with these tokens' entries written at `pos`."""
    return kv | {
        k: jax.lax.dynamic_update_slice_in_dim(kv[k], v.astype(kv[k].dtype), pos, 1)
        for k, v in new.items()
    }
