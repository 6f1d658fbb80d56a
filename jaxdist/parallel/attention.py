"""Causal self-attention on the mesh: the kernel each platform runs best, placed where it can
run (stage 2, with per-device control where the kernel needs it).

XLA's attention (CPU, and the reference) is partitioned by the compiler like any einsum; it
materializes the [B, N, T, S] scores and softmax in fp32. cuDNN's and splash's fused kernels
(jaxdist.kernels.attention) cannot be split by the SPMD partitioner: they run inside a
shard_map over the batch and head axes of the active rules (heads of one kv group stay on one
device). A sequence split over `context` goes to jaxdist.parallel.context. Packed documents
reach each kernel in the form it takes (`document_mask`): a dense bool mask for XLA and cuDNN,
segment ids for splash. Values narrower than the queries and keys (latent attention) are
padded to their width here, for every kernel (`padded_values`).

Legend: B batch  T query position  S key position  N query heads  G kv heads  H head_dim
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdist.kernels.attention import Implementation, cudnn_local, splash_local
from jaxdist.kernels.documents import Documents, attention_mask
from jaxdist.parallel import context
from jaxdist.rules import active, shard_map_here


def document_mask(implementation: Implementation, docs: Documents):
    """Packed documents as the kernel takes them: segment ids [B, T] for splash attention,
    else the bool mask [B, 1, T, S] (True where a query may see a key of its document); for a
    sequence split over devices, each token's place and document (context.Split)."""
    if docs.index_T is not None:
        return context.Split(docs.index_T, docs.segment_ids_BT)
    if implementation == "splash":
        return docs.segment_ids_BT
    return attention_mask(docs)


def attention(
    q_BTNH: jax.Array,
    k_BTGH: jax.Array,
    v_BTGH: jax.Array,
    mask: jax.Array | None,
    implementation: Implementation,
) -> jax.Array:
    """Causal attention of N query heads over G kv heads (query head n reads kv head
    n // (N / G)); `mask`: from `document_mask`, or None for one sequence per row. Values may
    be narrower than H (v_BTGW, W <= H): the output is then [B, T, N, W]."""
    W = v_BTGH.shape[-1]
    if W != q_BTNH.shape[-1]:
        v_BTGH = padded_values(v_BTGH, q_BTNH.shape[-1])
        return attention(q_BTNH, k_BTGH, v_BTGH, mask, implementation)[..., :W]
    if isinstance(mask, context.Split):
        return context.attend(q_BTNH, k_BTGH, v_BTGH, mask, implementation)
    if implementation == "splash":
        _, mesh = active()
        interpret = mesh.devices.flat[0].platform == "cpu"
        local = functools.partial(splash_local, interpret=interpret)
        # check_vma off (shard_map_here): the Pallas call carries no varying-axes annotations.
        return _per_device(local, q_BTNH, k_BTGH, v_BTGH, mask, P_SEGMENTS)
    if implementation == "cudnn" and jax.sharding.get_abstract_mesh().manual_axes:
        # Inside the pipeline's shard_map, cuDNN's custom partitioning fails on the partially
        # manual mesh (an assertion in jax 0.11's custom_partitioning): run it per device.
        return _per_device(cudnn_local, q_BTNH, k_BTGH, v_BTGH, mask, P_MASK)
    # XLA: the mask joins the causal mask on the scores. cuDNN: the public API turns the mask
    # into a dense [B, 1, T, S] bias and stays fused, forward and backward
    # (__cudnn$fmhaScaleBiasSoftmax). cuDNN's segment form (q/kv offsets, __cudnn$fmhaSoftmax,
    # no T x S tensor: 25.5 against 32.2 MiB temp memory measured at B=4, T=1024 on an H200) is
    # private API in jax 0.11 and refuses to lower where the local backend is not a Hopper GPU
    # (compile-only runs on a CPU host), so it is not used. The mask stays bool: given a float
    # bias instead, cuDNN's backward would compute the bias gradient too.
    return jax.nn.dot_product_attention(
        q_BTNH, k_BTGH, v_BTGH, mask=mask, is_causal=True, implementation=implementation
    )


def padded_values(v_BSGW: jax.Array, width: int) -> jax.Array:
    """Values padded with zero columns to the queries' and keys' `width`: jax's attention
    (XLA's, cuDNN's, splash) takes one head width for all three, and latent attention's values
    are narrower (DeepSeek-V3: 128 against 192). The output's extra columns are zeros, cut by
    the caller; the fused kernels stay fused, at (width / W) times the AV work."""
    pad = width - v_BSGW.shape[-1]
    if not pad:
        return v_BSGW
    return jnp.pad(v_BSGW, [(0, 0)] * (v_BSGW.ndim - 1) + [(0, pad)])


# The mask's layout by kind: segment ids [B, T] (splash) or a bool mask [B, 1, T, S] (cuDNN).
P_SEGMENTS, P_MASK = ("batch", None), ("batch", None, None, None)


def _per_device(local, q_BTNH, k_BTGH, v_BTGH, mask, mask_logical):
    """`local` on each device's rows and heads, in a shard_map over the batch and head axes of
    the active rules (heads of one kv group stay on one device); inside the pipeline the batch
    axes are manual already, and only the heads are split here."""
    rules, _ = active()
    batch = rules.mesh_axes("batch", "activation") or None
    heads = rules.mesh_axes("heads", "activation") or None
    kv_heads = rules.mesh_axes("kv_heads", "activation") or None
    q_spec, kv_spec = P(batch, None, heads, None), P(batch, None, kv_heads, None)
    args, specs = [q_BTNH, k_BTGH, v_BTGH], [q_spec, kv_spec, kv_spec]
    if mask is not None:
        args.append(mask)
        specs.append(P(batch, *mask_logical[1:]))
    return shard_map_here(local, tuple(specs), q_spec)(*args)
