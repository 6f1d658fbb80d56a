"""The fused cross-entropy: next-token loss of logits = h @ head without the whole logits.

The plain loss holds the [B, T, V] logits in fp32 and, in the backward pass, their gradient as
much again: 6.6 GB each for gpt2-124m at batch 32 (V = 50304), more than all its layers'
activations. Here the sequence is cut into chunks of at most `chunk_tokens` tokens per device;
each chunk's logits, log-sum-exp, loss and gradients are computed in one pass and dropped, so
no matmul runs twice (the backward pass only scales the gradients the forward pass made).

Legend: B batch  T seq  D embed  V vocab  S batch shards (one per device of the batch axes)
  b rows per shard  t positions per chunk  C chunks
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist.layout import ways
from jaxdist.rules import active, constrain, pin

# The most bytes a chunk's fp32 logits take on a device: at a large vocabulary the chunk holds
# fewer tokens than `chunk_tokens` asks. The TPU compiler's memory analysis counts this buffer
# about twice (experiments/README.md), so at Llama 3's 128,256 ids 2048 tokens (1.05 GB) held
# about 1 GB more than 1024 do (Llama-3-8B, fsdp=8 on v5p-16, 2 rows of 4096 a chip). Up to a
# 65,536-id vocabulary, 2048 tokens stay within it.
LOGITS_CHUNK_BYTES = 1 << 29


def chunk_tokens_for(vocab: int, chunk_tokens: int) -> int:
    """The most tokens a device's chunk holds: `chunk_tokens`, fewer where their fp32 logits
    would pass LOGITS_CHUNK_BYTES (at least 1)."""
    return max(1, min(chunk_tokens, LOGITS_CHUNK_BYTES // (4 * vocab)))


def _chunks(B: int, T: int, chunk_tokens: int) -> tuple[int, int]:
    """The batch's shards (one per device of the batch axes, so each device sums its own
    partial head gradient) and the sequence chunks: the fewest that hold at most
    `chunk_tokens` tokens per device."""
    rules, mesh = active()
    # Inside a shard_map (the pipeline's), the manual axes are already split: rows are local.
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    axes = [a for a in rules.mesh_axes("batch", "activation") if a not in manual]
    shards = ways(mesh.shape, axes)
    shards = shards if B % shards == 0 else 1
    rows = B // shards
    chunks = next((c for c in range(1, T + 1) if T % c == 0 and rows * T // c <= chunk_tokens), T)
    return shards, chunks


def _chunk_logits(h_SbtD, head_DV, vocab_size):
    logits_SbtV = jnp.einsum("sbtd,dv->sbtv", h_SbtD, head_DV, preferred_element_type=jnp.float32)
    logits_SbtV = constrain(logits_SbtV, ("batch", None, "seq", "vocab"))
    V = logits_SbtV.shape[-1]
    if vocab_size is not None and vocab_size < V:
        logits_SbtV = jnp.where(jnp.arange(V) < vocab_size, logits_SbtV, -jnp.inf)
    return logits_SbtV


def _fused_scan(h_BTD, head_DV, targets_BT, vocab_size, chunk_tokens, with_grads):
    """The loss summed chunk by chunk over the sequence; with `with_grads`, also the gradients
    of the mean loss, computed in the same pass: the softmax of a chunk, less the target's one,
    is the logits' gradient, used at once and dropped.

    In one chunk (a device's tokens fit), the head's gradient is one matmul, reduced over the
    batch's devices as the unfused loss's is (a reduce-scatter under FSDP). Over several, it
    accumulates in fp32 per batch shard [S, D, V], so no device waits on another inside the
    loop; the shards are summed once at the end, in the head's stored layout (_to_stored_layout:
    a reduce-scatter's bytes in the compute dtype)."""
    B, T, D = h_BTD.shape
    V = head_DV.shape[1]
    S, C = _chunks(B, T, chunk_tokens_for(V, chunk_tokens))
    t = T // C
    # [C, S, B/S, t, ...]: the scan runs over C; S splits over the batch's devices.
    h_CSbtD = h_BTD.reshape(S, B // S, C, t, D).transpose(2, 0, 1, 3, 4)
    tgt_CSbt = targets_BT.reshape(S, B // S, C, t).transpose(2, 0, 1, 3)
    count = B * T

    def chunk(h_SbtD, tgt_Sbt):
        h_SbtD = constrain(h_SbtD, ("batch", None, "seq", "embed"))
        logits_SbtV = _chunk_logits(h_SbtD, head_DV, vocab_size)
        lse_Sbt = jax.nn.logsumexp(logits_SbtV, axis=-1)
        onehot_SbtV = jax.nn.one_hot(tgt_Sbt, V, dtype=jnp.float32)
        # One-hot, not a gather: stays element-wise where the vocabulary is split over devices.
        target_Sbt = jnp.sum(jnp.where(onehot_SbtV > 0, logits_SbtV, 0.0), axis=-1)
        loss = jnp.sum(lse_Sbt - target_Sbt)
        if not with_grads:
            return loss, None, None
        dlogits_SbtV = (jnp.exp(logits_SbtV - lse_Sbt[..., None]) - onehot_SbtV) / count
        dlogits_SbtV = dlogits_SbtV.astype(h_SbtD.dtype)
        dh_SbtD = jnp.einsum("sbtv,dv->sbtd", dlogits_SbtV, head_DV)
        return loss, dlogits_SbtV, constrain(dh_SbtD, ("batch", None, "seq", "embed"))

    if C == 1:
        loss, dlogits_SbtV, dh_SbtD = chunk(h_CSbtD[0], tgt_CSbt[0])
        if not with_grads:
            return loss / count, None
        dlogits_BTV = constrain(dlogits_SbtV.reshape(B, T, V), ("batch", "seq", "vocab"))
        dhead_DV = jnp.einsum("btd,btv->dv", h_BTD, dlogits_BTV)
        return loss / count, (dh_SbtD.reshape(B, T, D), dhead_DV)

    def body(carry, xs):
        loss, dhead_SDV = carry
        part, dlogits_SbtV, dh_SbtD = chunk(*xs)
        if with_grads:
            dhead_SDV = dhead_SDV + jnp.einsum(
                "sbtd,sbtv->sdv", xs[0], dlogits_SbtV, preferred_element_type=jnp.float32
            )
            dhead_SDV = constrain(dhead_SDV, ("batch", None, "vocab"))
        return (loss + part, dhead_SDV), dh_SbtD

    zeros = jnp.zeros((S, D, V) if with_grads else (), jnp.float32)
    if with_grads:
        zeros = constrain(zeros, ("batch", None, "vocab"))
    (loss, dhead_SDV), dh_CSbtD = jax.lax.scan(body, (jnp.float32(0), zeros), (h_CSbtD, tgt_CSbt))
    if not with_grads:
        return loss / count, None
    dh_BTD = dh_CSbtD.transpose(1, 2, 0, 3, 4).reshape(B, T, D)
    # Each shard's fp32 sum rounded once to the head's dtype, then summed over the batch's
    # devices: the reduction moves compute-dtype bytes, as the unchunked matmul's would
    # (lax.reduce, not jnp.sum, which would sum 16-bit values in fp32, and so reduce them).
    dhead_SDV = dhead_SDV.astype(head_DV.dtype)
    dhead_SDV = _to_stored_layout(dhead_SDV)
    dhead_DV = jax.lax.reduce(dhead_SDV, jnp.zeros((), dhead_SDV.dtype), jax.lax.add, (0,))
    # The head's gradient is reduced before the layers' backward pass starts: the input
    # gradient waits on it. Otherwise XLA may leave the reduction until the optimizer needs it
    # and hold the fp32 accumulator, a whole [D, V] per device (2.1 GB at Llama 3's 128K
    # vocabulary), through the whole backward pass.
    dh_BTD, dhead_DV = jax.lax.optimization_barrier((dh_BTD, dhead_DV))
    return loss / count, (dh_BTD, dhead_DV)


def _to_stored_layout(dhead_SDV):
    """The shards' partial head gradients moved towards the head's stored layout before they
    are summed: over the batch axes the head is also split over (FSDP), each device takes its
    slice of every shard's sum (an all-to-all, a reduce-scatter's bytes); over the others the
    shards stay, summed by an all-reduce of the slice. Summed where they are, XLA's TPU
    partitioner all-reduces the whole [D, V] (262 MB a step on Llama-2-7B) and slices it."""
    rules, _ = active()
    stored = rules.spec(("embed", "vocab"), "param", "the output head")
    split = rules.mesh_axes("embed", "param") + rules.mesh_axes("vocab", "param")
    rest = tuple(a for a in rules.mesh_axes("batch", "activation") if a not in split)
    return pin(dhead_SDV, PartitionSpec(rest or None, *stored))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fused_cross_entropy(h_BTD, head_DV, targets_BT, vocab_size, chunk_tokens):
    """Mean next-token loss of logits_BTV = h_BTD @ head_DV in fp32, computed over chunks of
    the sequence (at most `chunk_tokens` tokens per device at once, fewer at a large
    vocabulary: chunk_tokens_for), forward and backward in one pass: the whole [B, T, V]
    logits and their gradient never exist. The backward pass only scales gradients the
    forward pass made, so no matmul runs twice. Ids >= vocab_size (padding of the model's
    vocabulary) get no probability."""
    return _fused_scan(h_BTD, head_DV, targets_BT, vocab_size, chunk_tokens, False)[0]


def _fused_fwd(h_BTD, head_DV, targets_BT, vocab_size, chunk_tokens):
    loss, grads = _fused_scan(h_BTD, head_DV, targets_BT, vocab_size, chunk_tokens, True)
    return loss, grads


def _fused_bwd(vocab_size, chunk_tokens, grads, g):
    dh_BTD, dhead_DV = grads
    return (dh_BTD * g.astype(dh_BTD.dtype), dhead_DV * g.astype(dhead_DV.dtype), None)


fused_cross_entropy.defvjp(_fused_fwd, _fused_bwd)
