"""The embedding lookup, its gradient reduce-scattered into the table's stored layout.

`jnp.take`'s transpose scatter-adds every token's gradient into a whole [V, D] table on each
device; XLA then sums those partial tables over every batch axis in one all-reduce and slices
the sum to the stored layout: 262 MB a step on Llama-2-7B at fsdp=8, the last full-size
gradient all-reduce of the step. Here each device scatter-adds its own tokens into its partial
table inside a shard_map over the batch and sequence axes; the partials are reduce-scattered
over those of them the table is stored split over (FSDP) and all-reduced over the rest, as the
layer weights' gradients are. It pays in nothing new: the partial table was there before.

Legend: B batch  T seq  D embed  V vocab
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist.rules import (
    activation_rules,
    active,
    active_context_strategy,
    as_tuple,
    constrain,
    position,
    ways,
)


def lookup(table_VD: jax.Array, ids_BT: jax.Array, logical: tuple[str, str]) -> jax.Array:
    """Rows `ids_BT` of `table_VD` (stored layout, compute dtype), the table used gathered as
    an activation; the gradient comes back in the stored layout (`logical`: the table's
    logical axes, vocabulary first)."""
    rules, mesh = active()
    strategy = active_context_strategy()

    @jax.custom_vjp
    def take(table_VD, ids_BT):
        return jnp.take(constrain(table_VD, logical), ids_BT, axis=0)

    def back(ids_BT, g_BTD):
        # The transpose may be traced after the caller's activation_rules has closed (a
        # jax.grad taken outside it): the rules in force where the table was used apply.
        with activation_rules(rules, mesh, strategy):
            return _scattered(table_VD.shape, ids_BT, g_BTD, logical), None

    take.defvjp(lambda t, i: (take(t, i), i), back)
    return take(table_VD, ids_BT)


def _scattered(shape_VD, ids_BT, g_BTD, logical) -> jax.Array:
    """The table's gradient in its stored layout: each device's scatter-add of its own tokens
    into its slice of the table as used, reduce-scattered over the token axes the table is
    stored split over, all-reduced over the other token axes."""
    rules, mesh = active()
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    # The axes tokens are split over; inside the pipeline's shard_map its manual ones are
    # already per device, summed by that shard_map's own transpose.
    token_axes = {
        a
        for a in rules.mesh_axes("batch", "activation") + rules.mesh_axes("seq", "activation")
        if mesh.shape[a] > 1 and a not in manual
    }
    used = [_only(e, set(mesh.axis_names) - manual) for e in rules.spec(logical, "activation")]
    if not token_axes:
        g_VD = constrain(jnp.zeros(shape_VD, g_BTD.dtype), logical).at[ids_BT].add(g_BTD)
        return constrain(g_VD, logical, "param")
    stored = rules.spec(logical, "param", "embedding table")
    # Per dim, the token axes it is stored split over, in the stored order.
    scatter = [tuple(a for a in as_tuple(entry) if a in token_axes) for entry in stored]
    summed = tuple(sorted(token_axes - {a for axes in scatter for a in axes}))
    vocab_axes = as_tuple(used[0])
    ring = mesh.devices.flat[0].platform == "tpu"
    rows = shape_VD[0] // ways(mesh.shape, vocab_axes)

    def body(ids_BT, g_BTD):
        # This device's rows of the table as used (the vocabulary split over `tensor`):
        # tokens outside them index past the end and are dropped.
        first = position(vocab_axes) * rows
        local_BT = jnp.where((ids_BT >= first) & (ids_BT < first + rows), ids_BT - first, rows)
        g_VD = jnp.zeros((rows, g_BTD.shape[-1]), g_BTD.dtype)
        g_VD = g_VD.at[local_BT].add(g_BTD, mode="drop")
        for dim, axes in enumerate(scatter):
            if axes:
                g_VD = reduce_scatter(g_VD, axes, dim, ways(mesh.shape, axes), ring)
        return jax.lax.psum(g_VD, summed) if summed else g_VD

    tokens = rules.spec(("batch", "seq"), "activation", "token ids")
    tokens = PartitionSpec(*(_only(entry, token_axes) for entry in tokens))
    out = PartitionSpec(
        *((as_tuple(u) + axes) or None for u, axes in zip(used, scatter, strict=True))
    )
    g_VD = jax.shard_map(
        body,
        in_specs=(tokens, PartitionSpec(*tokens, used[1])),
        out_specs=out,
        axis_names=token_axes | set(vocab_axes) | set(as_tuple(used[1])),
        check_vma=False,
        **({} if manual else {"mesh": mesh}),
    )(ids_BT, g_BTD)
    return constrain(g_VD, logical, "param")


def reduce_scatter(g: jax.Array, axes: tuple[str, ...], dim: int, n: int, ring: bool) -> jax.Array:
    """psum_scatter of `g` along `dim` over `axes` (n devices, each keeping its 1/n, in the
    order of a split over `axes`), inside a shard_map manual over them. `ring`: as n - 1
    collective-permutes of 1/n each, the bytes of a reduce-scatter. XLA's TPU compiler turns a
    lone reduce-scatter into an all-reduce of the whole buffer and a slice (its
    reduce-scatter-decomposer pass: twice the bytes), but keeps permutes as they are."""
    pieces = g.reshape(g.shape[:dim] + (n, g.shape[dim] // n) + g.shape[dim + 1 :])
    pieces = jnp.moveaxis(pieces, dim, 0)
    if not ring:
        return jax.lax.psum_scatter(pieces, axes, scatter_dimension=0)
    me = position(axes)
    ahead = [(i, (i + 1) % n) for i in range(n)]

    def piece(k):
        return jax.lax.dynamic_index_in_dim(pieces, k % n, keepdims=False)

    # The sum of piece k starts on device k + 1 and travels the ring, each device adding its
    # own piece k as it passes; after n - 1 hops it rests on device k.
    def hop(s, acc):
        return jax.lax.ppermute(acc, axes, ahead) + piece(me - 1 - s)

    return jax.lax.fori_loop(1, n, hop, piece(me - 1))


def _only(entry, axes: set[str]):
    kept = tuple(a for a in as_tuple(entry) if a in axes)
    return kept or None
