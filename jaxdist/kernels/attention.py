"""Causal self-attention by the kernel each platform runs best: cuDNN's fused attention on GPUs,
Pallas splash attention on TPUs, XLA's own everywhere (CPU, and the reference).

Legend: B batch  T query position  S key position  N query heads  G kv heads  H head_dim

XLA's attention materializes the [B, N, T, S] scores and softmax in fp32 (their memory grows
with T squared); the fused kernels never do: cuDNN's keeps a log-sum-exp per row, splash
attention (jax.experimental.pallas.ops.tpu.splash_attention, what MaxText runs) works block by
block and skips the blocks the causal and document masks leave empty. Packed documents reach
each kernel in the form it takes (`document_mask`): a dense bool mask for XLA and cuDNN,
segment ids for splash.

Splash attention is a Pallas TPU kernel, which the SPMD partitioner cannot split: it runs
inside a shard_map over the batch and head axes of the active rules (heads of one kv group stay
on one device). On CPU meshes it runs in Pallas interpret mode, so tests check it against XLA's.
"""

import functools
from typing import Literal

import jax
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.kernels.documents import Documents, attention_mask
from jaxdist.parallel import context
from jaxdist.rules import active, shard_map_here

Implementation = Literal["xla", "cudnn", "splash"]
# Splash attention's tiles along the query and key positions: 512 is MaxText's choice on v5p
# (256 or 128 where the sequence is not a multiple of 512).
SPLASH_BLOCK = 512
# The name (jax.ad_checkpoint.checkpoint_name) splash attention gives what its backward reads
# of its forward: the output and the per-row log-sum-exp, sliced [.., T] out of the kernel's
# 128-lane copy (128 times smaller). A remat policy saves these by name; saving the
# pallas_call's outputs instead would keep the 128-lane copy, 4.3 GB per chip on Llama-2-7B.
RESIDUALS = "attention_residuals"


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
    n // (N / G)); `mask`: from `document_mask`, or None for one sequence per row."""
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


def cudnn_local(q_BTNH, k_BTGH, v_BTGH, mask=None):
    return jax.nn.dot_product_attention(
        q_BTNH, k_BTGH, v_BTGH, mask=mask, is_causal=True, implementation="cudnn"
    )


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


def splash_local(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT=None, *, interpret: bool):
    """This device's rows and heads: one MQA kernel per (row, kv head) over its query heads."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, N, H = q_BTNH.shape
    G = k_BTGH.shape[2]
    mask = splash.MultiHeadMask([splash.CausalMask((T, T))] * (N // G))
    kernel = splash.make_splash_mqa_single_device(
        mask=mask,
        block_sizes=splash_blocks(T),
        residual_checkpoint_name=RESIDUALS,
        interpret=interpret,
    )
    return splash_per_group(kernel, q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, segment_ids_BT)


def splash_blocks(T: int):
    """Splash attention's tiles for T query positions on a device."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    block = next((b for b in (SPLASH_BLOCK, 256, 128) if T % b == 0), None)
    if block is None:
        raise ConfigError(
            f"splash attention tiles the sequence in blocks of 128 positions; {T} positions "
            f"per device is not a multiple of 128: use a --seq-len that makes it one"
        )
    return splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )


def splash_per_group(kernel, q_BTNH, k_BSGH, v_BSGH, seg_q_BT, seg_kv_BS):
    """An MQA splash kernel run per (row, kv head) over that head's queries; segment ids of
    the queries and keys (None: one document per row)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, N, H = q_BTNH.shape
    G = k_BSGH.shape[2]
    # Splash attention does not scale the scores: scale the queries.
    q_BGnTH = (q_BTNH * (H**-0.5)).reshape(B, T, G, N // G, H).transpose(0, 2, 3, 1, 4)
    k_BGSH, v_BGSH = k_BSGH.transpose(0, 2, 1, 3), v_BSGH.transpose(0, 2, 1, 3)

    def one(q_nTH, k_SH, v_SH, seg_q_T, seg_kv_S):
        ids = None if seg_q_T is None else splash.SegmentIds(q=seg_q_T, kv=seg_kv_S)
        return kernel(q_nTH, k_SH, v_SH, segment_ids=ids)

    seg_axis = None if seg_q_BT is None else 0
    per_group = jax.vmap(one, in_axes=(0, 0, 0, None, None))
    o_BGnTH = jax.vmap(per_group, in_axes=(0, 0, 0, seg_axis, seg_axis))(
        q_BGnTH, k_BGSH, v_BGSH, seg_q_BT, seg_kv_BS
    )
    return o_BGnTH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q_BTNH.dtype)
