"""Causal self-attention kernels on one device's rows and heads: cuDNN's fused attention on
GPUs, Pallas splash attention on TPUs (jaxdist.parallel.attention chooses one and runs it per
device; XLA's own attention needs no kernel of its own).

Legend: B batch  T query position  S key position  N query heads  G kv heads  H head_dim

The fused kernels never materialize the [B, N, T, S] scores: cuDNN's keeps a log-sum-exp per
row, splash attention (jax.experimental.pallas.ops.tpu.splash_attention, what MaxText runs)
works block by block and skips the blocks the causal and document masks leave empty. On CPU
meshes splash runs in Pallas interpret mode, so tests check it against XLA's.
"""

from typing import Literal

import jax

from jaxdist.errors import ConfigError

Implementation = Literal["xla", "cudnn", "splash"]
# Splash attention's tiles along the query and key positions: 512 is MaxText's choice on v5p
# (256 or 128 where the sequence is not a multiple of 512).
SPLASH_BLOCK = 512
# The name (jax.ad_checkpoint.checkpoint_name) splash attention gives what its backward reads
# of its forward: the output and the per-row log-sum-exp, sliced [.., T] out of the kernel's
# 128-lane copy (128 times smaller). A remat policy saves these by name; saving the
# pallas_call's outputs instead would keep the 128-lane copy, 4.3 GB per chip on Llama-2-7B.
RESIDUALS = "attention_residuals"


def cudnn_local(q_BTNH, k_BTGH, v_BTGH, mask=None):
    return jax.nn.dot_product_attention(
        q_BTNH, k_BTGH, v_BTGH, mask=mask, is_causal=True, implementation="cudnn"
    )


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
