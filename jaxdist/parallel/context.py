"""Context parallelism: the sequence split over the `context` mesh axis, attention exact across it.

The rule table maps the activations' `seq` axis to `context` (its devices hold different
tokens of the same rows); everything but attention is per token, so jit's shardings realize
it. Attention needs the keys of other devices, in one of three ways (`--context-strategy`):

  all-gather  K and V gathered over `context`; each device attends its own queries to every
              key. Pays one all-gather of K/V per layer (and a reduce-scatter of their
              gradients), K/V memory of the whole sequence; simplest, MaxText's default.
  ring        K/V chunks passed round the ring with ppermute, cp steps, partial results merged
              by their log-sum-exp (flash attention's rule); the backward, by autodiff of the
              ring, passes dK/dV round the other way. Pays cp permutes of 1/cp of K/V, each
              overlappable with a chunk's attention; never holds more than 2 chunks of K/V.
  ulysses     all-to-all from sequence-split to head-split, whole-sequence attention on 1/cp of
              the heads, all-to-all back (DeepSpeed Ulysses). Pays 4 all-to-alls of 1/cp of
              Q/K/V/O; needs the query heads (per tensor shard) to divide by cp, and repeats
              kv heads where there are fewer than cp (GQA).

Causal load balance: split naively, device cp-1 holds the last tokens, which see the whole
row, and device 0 the first, which see little. The sequence is cut into 2cp chunks and
reordered once, before the model, so device i holds chunks i and 2cp-1-i (torchtitan's and
MaxText's head-tail order). Positions (RoPE, learned) and document ids travel with the tokens,
the targets too, so the loss is unchanged; attention's mask compares each token's place in the
row (`Documents.index_T`), not its place on the device.

Legend: B batch  T seq  N query heads  G kv heads  R query heads per kv head  H head_dim
  S key positions  t, s a device's share of them
"""

import functools
import math
from typing import NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.kernels import attention as kernels
from jaxdist.kernels import documents
from jaxdist.kernels.documents import Documents
from jaxdist.layout import ContextStrategy, ways
from jaxdist.rules import active, active_layout, position, shard_map_here

STRATEGIES: tuple[str, ...] = get_args(ContextStrategy)


class Split(NamedTuple):
    """What attention needs of a context-split sequence: each token's place in the row
    [T] (causality) and its document id [B, T] (None: one document per row)."""

    index_T: jax.Array
    segment_ids_BT: jax.Array | None


def carrier(strategy: str, platform: str, pipelined: bool) -> str:
    """How a strategy's exchange is carried: the strategy's own collective, except the ring
    on CPU inside pipeline stages ("ring-by-gather"). XLA's CPU runtime (jax 0.11.2) crashes
    (SIGSEGV) on a collective-permute inside a conditional branch that not every device takes,
    as a stage's tick is; all-gathers there run. So each hop's chunk comes by an all-gather
    over the ring (its gradient by a reduce-scatter), cp times the permute's bytes: the same
    values, so the pipelined ring is tested on CPU. GPU and TPU permute as everywhere."""
    if strategy == "ring" and platform == "cpu" and pipelined:
        return "ring-by-gather"
    return strategy


def ways_here() -> int:
    """How many devices split the sequence under the active rules (1: none)."""
    rules, mesh = active()
    return ways(mesh.shape, rules.mesh_axes("seq", "activation"))


def balanced_order(T: int, cp: int) -> np.ndarray:
    """The permutation of positions 0..T-1 that gives device i chunks i and 2cp-1-i."""
    if T % (2 * cp):
        raise ConfigError(
            f"context parallelism over {cp} devices cuts the sequence into {2 * cp} equal "
            f"chunks (two per device, for causal balance); --seq-len {T} is not a multiple of "
            f"{2 * cp}: use --seq-len {max(2 * cp, T // (2 * cp) * 2 * cp)}"
        )
    c = T // (2 * cp)
    chunks = [k for i in range(cp) for k in (i, 2 * cp - 1 - i)]
    return np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks])


def inputs_and_targets(tokens_BT1: jax.Array, eos_id: int | None):
    """A [B, T+1] token batch as next-token inputs, targets and documents (found from `eos_id`
    where rows pack documents; None: one sequence per row), in the balanced order where the
    sequence is split, documents found first."""
    inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    docs = None if eos_id is None else documents.from_tokens(inputs_BT, eos_id)
    return split_sequence(inputs_BT, targets_BT, docs)


def split_sequence(inputs_BT, targets_BT, docs: Documents | None):
    """Inputs, targets and documents in the balanced order, and the documents carrying each
    token's place in the row; unchanged where the sequence is not split."""
    cp = ways_here()
    if cp == 1:
        return inputs_BT, targets_BT, docs
    T = inputs_BT.shape[1]
    order = balanced_order(T, cp)
    if docs is None:  # one document per row: positions are places; no ids to compare
        positions_BT, segments_BT = jnp.arange(T, dtype=jnp.int32)[None], None
    else:
        positions_BT, segments_BT = docs.positions_BT, docs.segment_ids_BT
    take = lambda x: None if x is None else x[:, order]  # noqa: E731
    placed = Documents(take(segments_BT), take(positions_BT), jnp.asarray(order, jnp.int32))
    return take(inputs_BT), take(targets_BT), placed


def attend(q_BTNH, k_BTGH, v_BTGH, split: Split, implementation: str) -> jax.Array:
    """Causal attention of a context-split sequence (queries, keys and values in the balanced
    order), by the active strategy, in a shard_map over batch, sequence and head axes."""
    rules, mesh = active()
    strategy = active_layout().step.context_strategy
    batch = rules.mesh_axes("batch", "activation") or None
    seq = rules.mesh_axes("seq", "activation")
    heads = rules.mesh_axes("heads", "activation") or None
    kv_heads = rules.mesh_axes("kv_heads", "activation") or None
    cp = ways(mesh.shape, seq)
    if implementation == "splash":
        if set(seq) & set(jax.sharding.get_abstract_mesh().manual_axes):
            raise ConfigError(
                "splash attention across `context` inside pipeline stages is not built: add "
                "--attention xla, or use a mesh without a pipeline axis"
            )
        if strategy == "ring":
            raise ConfigError(
                "--context-strategy ring runs with XLA's attention; with splash attention "
                "(TPU) use --context-strategy all-gather or ulysses, or --attention xla"
            )
        if strategy == "all-gather":
            axes = (batch, seq, heads, kv_heads)
            return _splash_all_gather(q_BTNH, k_BTGH, v_BTGH, split, axes)
    local_n = q_BTNH.shape[2] // ways(mesh.shape, heads or ())
    if strategy == "ulysses" and local_n % cp:
        raise ConfigError(
            f"--context-strategy ulysses splits the heads over context: {local_n} query heads "
            f"per tensor shard do not divide by context={cp}; use --context-strategy all-gather "
            "or ring"
        )
    q_spec, kv_spec = P(batch, seq, heads, None), P(batch, seq, kv_heads, None)
    local = {"all-gather": _all_gather, "ring": _ring, "ulysses": _ulysses}[strategy]
    segments = split.segment_ids_BT
    if segments is None:  # an operand all the same; `run` drops it
        segments = jnp.zeros((q_BTNH.shape[0], q_BTNH.shape[1]), jnp.int32)

    docs = split.segment_ids_BT is not None

    def run(q, k, v, index, seg):
        return local(q, k, v, index, seg if docs else None, seq, cp, implementation)

    specs = (q_spec, kv_spec, kv_spec, P(seq), P(batch, seq))
    return shard_map_here(run, specs, q_spec)(q_BTNH, k_BTGH, v_BTGH, split.index_T, segments)


def _allowed(index_q_t, index_k_s, seg_q_bt, seg_k_bs) -> jax.Array:
    """[b, t, s] bool: query t may see key s (same document, not after it in the row); no
    document ids (None): one document per row."""
    causal_ts = index_k_s[None, :] <= index_q_t[:, None]
    if seg_q_bt is None:
        return causal_ts[None]
    return causal_ts[None] & (seg_q_bt[:, :, None] == seg_k_bs[:, None, :])


def _dense(q, k, v, allowed_bts, implementation):
    return jax.nn.dot_product_attention(
        q, k, v, mask=allowed_bts[:, None], implementation=implementation
    )


def _all_gather(q, k, v, index_t, seg_bt, axis, cp, implementation):
    k_all = jax.lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    index_s = jax.lax.all_gather(index_t, axis, axis=0, tiled=True)
    seg_bs = None if seg_bt is None else jax.lax.all_gather(seg_bt, axis, axis=1, tiled=True)
    return _dense(q, k_all, v_all, _allowed(index_t, index_s, seg_bt, seg_bs), implementation)


def _ulysses(q, k, v, index_t, seg_bt, axis, cp, implementation):
    # Sequence-split, all heads -> whole sequence, 1/cp of the heads; the whole sequence comes
    # in device order, as all_gather's, so the gathered places and ids line up with it.
    to_heads = lambda x: jax.lax.all_to_all(x, axis, 2, 1, tiled=True)  # noqa: E731
    index_T = jax.lax.all_gather(index_t, axis, axis=0, tiled=True)
    seg_BT = None if seg_bt is None else jax.lax.all_gather(seg_bt, axis, axis=1, tiled=True)
    # Query heads stay with their kv head: heads n..n+R of group g go where group g goes.
    b, t, N, H = q.shape
    # Fewer kv heads than devices (GQA): each is repeated, consecutively, so query head n
    # still reads kv head n // R (R the query heads per repeated kv head); K/V cost f x bytes.
    f = cp // math.gcd(k.shape[2], cp)
    k, v = jnp.repeat(k, f, axis=2), jnp.repeat(v, f, axis=2)
    G = k.shape[2]
    q_btGRH = q.reshape(b, t, G, N // G, H)
    q_bTgRH = jax.lax.all_to_all(q_btGRH, axis, 2, 1, tiled=True)
    q_bTnH = q_bTgRH.reshape(b, t * cp, N // cp, H)
    if implementation == "xla":
        allowed = _allowed(index_T, index_T, seg_BT, seg_BT)
        o_bTnH = _dense(q_bTnH, to_heads(k), to_heads(v), allowed, implementation)
    else:
        o_bTnH = _kernel_in_row_order(q_bTnH, to_heads(k), to_heads(v), seg_BT, cp, implementation)
    o_btGRH = jax.lax.all_to_all(o_bTnH.reshape(q_bTgRH.shape), axis, 1, 2, tiled=True)
    return o_btGRH.reshape(b, t, N, H)


def _kernel_in_row_order(q_BTnH, k_BTgH, v_BTgH, seg_BT, cp, implementation):
    """The whole sequence by the platform's fused kernel (splash, cuDNN), as without a split:
    the tokens put back in row order first (the balanced order is fixed by T and cp, so this
    is a static permutation on the device, no traffic), causal there, then returned to the
    balanced order. No [T, T] scores: the kernel works block by block."""
    order = balanced_order(q_BTnH.shape[1], cp)
    back = np.argsort(order)
    row = lambda x: None if x is None else x[:, back]  # noqa: E731
    q, k, v, seg = row(q_BTnH), row(k_BTgH), row(v_BTgH), row(seg_BT)
    if implementation == "splash":
        _, mesh = active()
        interpret = mesh.devices.flat[0].platform == "cpu"
        o_BTnH = kernels.splash_local(q, k, v, seg, interpret=interpret)
    else:  # cuDNN takes documents as a bool mask, as without a split
        mask = None if seg is None else (seg[:, None, :, None] == seg[:, None, None, :])
        o_BTnH = kernels.cudnn_local(q, k, v, mask)
    return o_BTnH[:, order]


# A score that is masked out: finite, so a key chunk that a query cannot see at all gives
# weights exp(-1e30 - lse) = 0 when merged, not NaN (inf - inf).
_MASKED = -1e30


def _ring(q, k, v, index_t, seg_bt, axis, cp, implementation):
    """Flash attention's merge over the ring: chunk j of K/V arrives at step j, its partial
    output and log-sum-exp are folded into the running ones."""
    b, t, N, H = q.shape
    G = k.shape[2]
    q_btGRH = (q.astype(jnp.float32) * H**-0.5).reshape(b, t, G, N // G, H)
    _, mesh = active()
    pipelined = mesh.shape.get("pipeline", 1) > 1
    by_gather = carrier("ring", mesh.devices.flat[0].platform, pipelined) != "ring"

    def pass_on(x):  # to the next device of the ring, from the previous one
        if x is None:  # no document ids
            return None
        if not by_gather:
            return jax.lax.ppermute(x, axis, [(j, (j + 1) % cp) for j in range(cp)])
        previous = (position(axis) - 1) % cp
        everyone = jax.lax.all_gather(x, axis)
        return jax.lax.dynamic_index_in_dim(everyone, previous, keepdims=False)

    o_btGRH = lse_bGRt = None
    kv = (k, v, index_t, seg_bt)
    for step in range(cp):
        k_s, v_s, index_s, seg_bs = kv
        scores = jnp.einsum("btgrh,bsgh->bgrts", q_btGRH, k_s.astype(jnp.float32))
        allowed = _allowed(index_t, index_s, seg_bt, seg_bs)[:, None, None]
        scores = jnp.where(allowed, scores, _MASKED)
        lse_c = jax.nn.logsumexp(scores, axis=-1)
        o_c = jnp.einsum("bgrts,bsgh->btgrh", jnp.exp(scores - lse_c[..., None]), v_s)
        if step == 0:
            o_btGRH, lse_bGRt = o_c, lse_c
            kv = tuple(pass_on(x) for x in kv)
            continue
        merged = jnp.logaddexp(lse_bGRt, lse_c)
        w_old = jnp.exp(lse_bGRt - merged).transpose(0, 3, 1, 2)[..., None]
        w_new = jnp.exp(lse_c - merged).transpose(0, 3, 1, 2)[..., None]
        o_btGRH, lse_bGRt = o_btGRH * w_old + o_c * w_new, merged
        if step < cp - 1:  # the next chunk, from the neighbour; overlappable with this one
            kv = tuple(pass_on(x) for x in kv)
    return o_btGRH.reshape(b, t, N, H).astype(q.dtype)


def _splash_all_gather(q_BTNH, k_BTGH, v_BTGH, split: Split, axes) -> jax.Array:
    """All-gather with splash attention (TPU; Pallas interpret mode on CPU), as MaxText runs
    it: one kernel for the whole [T, T] mask, its block tables split over the devices' query
    shards (`q_seq_shards`), K/V gathered and put back in row order, so the mask is causal
    over each query's place (`_balanced_class`) and whole key blocks are skipped as usual."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
    from jax.sharding import NamedSharding

    _, mesh = active()
    batch, seq, heads, kv_heads = axes
    B, T, N, _ = q_BTNH.shape
    G = k_BTGH.shape[2]
    cp = ways(mesh.shape, seq)
    order = balanced_order(T, cp)
    back = np.argsort(order)  # gathered (balanced) order -> row order
    kernel = splash.make_splash_mqa(
        mask=splash.MultiHeadMask([_balanced_class()(T, order)] * (N // G)),
        block_sizes=kernels.splash_blocks(T // cp),
        head_shards=1,
        q_seq_shards=cp,
        residual_checkpoint_name=kernels.RESIDUALS,
        interpret=mesh.devices.flat[0].platform == "cpu",
    )
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, seq)))
    docs = split.segment_ids_BT is not None

    def run(q, k, v, kernel, *seg):
        gather = lambda x: jax.lax.all_gather(x, seq, axis=1, tiled=True)[:, back]  # noqa: E731
        seg_q = seg[0] if docs else None
        seg_kv = gather(seg[0]) if docs else None
        return kernels.splash_per_group(kernel, q, gather(k), gather(v), seg_q, seg_kv)

    q_spec, kv_spec = P(batch, seq, heads, None), P(batch, seq, kv_heads, None)
    specs = (q_spec, kv_spec, kv_spec, kernel_spec) + ((P(batch, seq),) if docs else ())
    args = (q_BTNH, k_BTGH, v_BTGH, kernel) + ((split.segment_ids_BT,) if docs else ())
    return shard_map_here(run, specs, q_spec)(*args)


@functools.cache
def _balanced_class():
    """Splash's in-kernel mask base, subclassed on first use (Pallas loads only then)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask

    class Balanced(splash_attention_mask._ComputableMask):
        """Causal over each query's place in the row, queries in the balanced order (their
        places: `q_sequence`, which splash reads per query block), keys in row order."""

        def __init__(self, T: int, order: np.ndarray):
            super().__init__((T, T), lambda q_ids, kv_ids: q_ids >= kv_ids)
            self.q_sequence = np.asarray(order, np.int32)

        def __eq__(self, other):
            same = isinstance(other, Balanced) and self.shape == other.shape
            return same and np.array_equal(self.q_sequence, other.q_sequence)

        def __hash__(self):
            return hash((self.shape, self.q_sequence.tobytes()))

    return Balanced
