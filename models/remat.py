"""Rematerialization policies: what a layer keeps for the backward pass and what it recomputes
(`--remat`), as jax.checkpoint policies over the layer's primitives and named values.

From fastest to leanest (`ORDER`, what `--remat auto` walks): none keeps everything; dots keeps
the matmul outputs and the attention kernel's residuals and recomputes only element-wise work;
dots_except_mlp keeps the attention block's matmuls (fused QKV, output projection) and kernel
residuals, and recomputes the MLP; full keeps each layer's input and recomputes the whole
layer. Beside them, offload keeps dots' set in pinned host memory instead of on the device
(asked for by name only: see ORDER). `RECOMPUTE` prices each in recomputed matmul FLOPs.
"""

from collections.abc import Callable

import jax
from jax.ad_checkpoint import Offloadable, checkpoint_name

from jaxdist.kernels.attention import RESIDUALS

# What models/transformer.py names with `checkpoint_name` for the policies that save by name.
QKV_PROJ, OUT_PROJ = "qkv_proj", "out_proj"
__all__ = ["ORDER", "OUT_PROJ", "POLICIES", "QKV_PROJ", "RECOMPUTE", "checkpoint_name"]


# Gathered (FSDP) weights are never saved for the backward pass, whatever the policy: the
# backward loop gathers each layer again, since keeping all of them would undo FSDP's saving.
def _save_all_but_gathered(prim, *_, **params) -> bool:
    # A sharding constraint's output (or, inside shard_map, an all_gather's) is where a
    # gathered weight first appears, so it is recomputed (re-gathered) rather than saved; on
    # activations a constraint is a free identity.
    return prim.name not in ("sharding_constraint", "all_gather")


def _attention_kernel(prim, params) -> bool:
    # cuDNN's fused kernel (its output and softmax statistics), or splash attention's output
    # and sliced log-sum-exp, which it names (jaxdist.kernels.attention.RESIDUALS): never its
    # pallas_call's outputs, which hold the log-sum-exp 128 times over.
    return prim.name.startswith("dot_product_attention_fwd") or _named(prim, params, {RESIDUALS})


def _named(prim, params, names) -> bool:
    return prim.name == "name" and params["name"] in names


def _save_dots_and_attention(prim, *args, **params) -> bool:
    # Matmul outputs and the fused attention kernel's residuals: the backward pass recomputes
    # only element-wise work (norms, activations, casts), as torch.compile's partitioner does,
    # and never reruns the attention kernel.
    if _attention_kernel(prim, params):
        return True
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)


def _save_dots_except_mlp(prim, *_, **params) -> bool:
    # MaxText's save_dot_except_mlp, keeping the kernel's residuals too: the MLP's matmuls (two
    # thirds or more of a layer's) are recomputed, so its [B, T, F] outputs are not kept.
    return _attention_kernel(prim, params) or _named(prim, params, {QKV_PROJ, OUT_PROJ})


_TO_HOST = Offloadable(src="device", dst="pinned_host")


def _offload_dots_and_attention(prim, *args, **params):
    # dots' set, copied to pinned host memory in the forward pass and back in the backward.
    return _TO_HOST if _save_dots_and_attention(prim, *args, **params) else False


POLICIES = {
    "none": _save_all_but_gathered,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": _save_dots_and_attention,
    "dots_except_mlp": _save_dots_except_mlp,
    "offload": _offload_dots_and_attention,
}
# Fastest first: `--remat auto` runs the first that fits. Recomputing the MLP (dots_except_mlp)
# costs FLOPs the planner prices. offload is not in the order: it recomputes nothing but copies
# dots' set to the host and back, hidden only where the host link keeps up (Llama-2-7B at 4
# rows of 2048 per v5p chip offloads 0.70 GB a layer against the layer's 22 ms at peak, about
# 65 GB/s per chip; PCIe 5.0 x16 carries 64 GB/s each way at most). Neither that link nor the
# copies' overlap has been measured on hardware, so the planner cannot price it, and on TPU its
# peak (24.8 GB there) is above full's (21.5 GB). Ask for it by name.
ORDER = ("none", "dots", "dots_except_mlp", "full")


def _mlp_share(c) -> float:
    """The MLP's share of a layer's forward matmul FLOPs per token (attention's scores and
    weighted sum, and a MoE router, left out): (2 or 3) * D * F * top_k over that plus fused
    QKV's D * (N + 2G) * H and the output projection's N * H * D."""
    D, H, N, G = c.d_model, c.head_dim, c.num_heads, c.num_kv_heads
    mlp = (3 if c.style == "llama" else 2) * D * c.d_mlp * (c.top_k if c.num_experts else 1)
    return mlp / (mlp + D * (N + 2 * G) * H + N * H * D)


# Per policy, a model config -> the share of a layer's forward matmul FLOPs its backward pass
# recomputes: 0 (none, dots: only element-wise work; offload: none, it copies instead), the
# MLP's share (dots_except_mlp: 0.67 for Llama-2-7B, 3DF / (4D^2 + 3DF)), 1 (full: a whole
# forward). Attention's own matmuls are left out: only full reruns a fused kernel, while XLA's
# attention (batched matmuls, never saved) is recomputed by every policy but none.
RECOMPUTE: dict[str, Callable[..., float]] = {
    "none": lambda c: 0.0,
    "dots": lambda c: 0.0,
    "dots_except_mlp": _mlp_share,
    "offload": lambda c: 0.0,
    "full": lambda c: 1.0,
}
