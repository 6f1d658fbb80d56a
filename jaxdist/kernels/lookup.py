"""The embedding lookup: tokens routed to the table's slices, or the table gathered to them.

Routed (where a device holds fewer tokens a microbatch than table rows, and the table is not
also the head): the table stays in its stored layout, split over FSDP along D. Each device
gathers the token ids of its FSDP group (int32, a few KB), looks them all up in its own D
slice, and an all-to-all returns each device its own tokens' rows whole; the backward runs the
same all-to-all the other way and scatter-adds into the slice, which is the gradient in the
stored layout: nothing is gathered or reduce-scattered whole, and no gathered table is held.
It pays in tokens instead of table rows: (n - 1) / n of B T D each way, against the gathered
path's (n - 1) / n of V D each way (Llama-2-7B at fsdp=8, 4 rows of 2048: 59 MB against 230
MB; Llama 3's 128K vocabulary: four times that). With M microbatches the gathered table is
gathered once a step and its gradient reduce-scattered M times, so routing sends fewer bytes
only below (M + 1) / 2M of the rows a device holds: the choice's threshold.

Gathered, otherwise:

`jnp.take`'s transpose scatter-adds every token's gradient into a whole [V, D] table on each
device; XLA then sums those partial tables over every batch axis in one all-reduce and slices
the sum to the stored layout: 262 MB a step on Llama-2-7B at fsdp=8, the last full-size
gradient all-reduce of the step. Here each device scatter-adds its own tokens into its partial
table inside a shard_map over the batch and sequence axes; the partials are reduce-scattered
over those of them the table is stored split over (FSDP) and all-reduced over the rest, as the
layer weights' gradients are. It pays in nothing new: the partial table was there before.

Legend: B batch  T seq  D embed  V vocab
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist.layout import as_tuple, ways
from jaxdist.rules import (
    activation_rules,
    active,
    active_layout,
    constrain,
    entered,
    logical_axes,
    position,
    variables,
)


def lookup(
    table_VD: jax.Array, ids_BT: jax.Array, logical: tuple[str, str], tied: bool = False
) -> jax.Array:
    """Rows `ids_BT` of `table_VD` (stored layout, compute dtype), routed or gathered (see
    above); the gradient comes back in the stored layout (`logical`: the table's logical
    axes, vocabulary first). `tied`: the table is the output head too, gathered for the
    logits anyway, so the lookup takes it gathered."""
    rules, mesh = active()
    here = entered()
    # Inside a pipeline's shard_map (manual axes) the stages look up in the gathered table.
    # So do replica groups: jax 0.11 cannot map a shard_map's transpose over them (vmap with
    # spmd_axis_name), and the partitioner's own gather and scatter-add serve.
    inside = bool(jax.sharding.get_abstract_mesh().manual_axes) or active_layout().in_group
    route = None
    if not (tied or inside):
        shapes = (table_VD.shape, ids_BT.shape)
        route = routing(rules, mesh.shape, *shapes, logical, active_layout().microbatches)
    if route is not None:
        return _routed(table_VD, ids_BT, logical, route, here)

    @jax.custom_vjp
    def take(table_VD, ids_BT):
        return jnp.take(constrain(table_VD, logical), ids_BT, axis=0)

    def back(ids_BT, g_BTD):
        # The transpose may be traced after the caller's activation_rules has closed (a
        # jax.grad taken outside it): the layout in force where the table was used applies.
        with activation_rules(*here):
            return _scattered(table_VD.shape, ids_BT, g_BTD, logical), None

    take.defvjp(lambda t, i: (take(t, i), i), back)
    return take(table_VD, ids_BT)


def _scattered(shape_VD, ids_BT, g_BTD, logical) -> jax.Array:
    """The table's gradient in its stored layout: each device's scatter-add of its own tokens
    into its slice of the table as used, reduce-scattered over the token axes the table is
    stored split over, all-reduced over the other token axes."""
    rules, mesh = active()
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    # Inside the pipeline's shard_map its manual axes are already per device, summed by that
    # shard_map's own transpose.
    token_axes, tokens = _token_split(rules, mesh.shape, manual)
    if active_layout().in_group:
        token_axes = set()
    used = [_only(e, set(mesh.axis_names) - manual) for e in rules.spec(logical, "activation")]
    if not token_axes:
        g_VD = constrain(jnp.zeros(shape_VD, g_BTD.dtype), logical).at[ids_BT].add(g_BTD)
        return constrain(g_VD, logical, "param")
    stored = rules.spec(logical, "param", "embedding table")
    # Per dim, the token axes it is stored split over, in the stored order.
    scatter = [tuple(a for a in as_tuple(entry) if a in token_axes) for entry in stored]
    summed = tuple(sorted(token_axes - {a for axes in scatter for a in axes}))
    vocab_axes = as_tuple(used[0])
    platform = mesh.devices.flat[0].platform
    rows = shape_VD[0] // ways(mesh.shape, vocab_axes)

    def body(ids_BT, g_BTD):
        g_VD = jnp.zeros((rows, g_BTD.shape[-1]), g_BTD.dtype)
        g_VD = g_VD.at[_local_rows(ids_BT, vocab_axes, rows)].add(g_BTD, mode="drop")
        for dim, axes in enumerate(scatter):
            if axes:
                n = ways(mesh.shape, axes)
                scattered = functools.partial(reduce_scatter, axes=axes, dim=dim, n=n)
                g_VD = summed_on(platform, scattered, g_VD, ring=platform == "tpu")
        return summed_on(platform, jax.lax.psum, g_VD, summed) if summed else g_VD

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


@dataclasses.dataclass(frozen=True)
class Route:
    """A routed lookup's layout: `split` the axes the table's D is stored split over (all of
    them token axes), `vocab` those its rows are split over (`tensor`), `summed` the other
    token axes, which hold other tokens for the same slice (`data`): its gradient's sum.
    `tokens_spec`: the token ids' split over the token axes; `rows`: the table's rows on a
    device; `tokens`: a device's tokens a microbatch."""

    split: tuple[str, ...]
    vocab: tuple[str, ...]
    summed: tuple[str, ...]
    tokens_spec: PartitionSpec
    rows: int
    tokens: int


def routing(rules, mesh_shape, shape_VD, shape_BT, logical, microbatches: int) -> Route | None:
    """The routed lookup's layout where it applies (the table's D stored split over token axes
    only, its rows over no token axis, D whole as used, the tokens dividing their split) and
    sends fewer bytes than the gathered path: 2 M tokens each way against the table gathered
    once and reduce-scattered M times, (M + 1) rows (`shape_BT`: a microbatch's tokens). Else
    None. Shapes and rules only: jaxdist.planning.traffic and memory price the same choice."""

    def split_over(entry) -> tuple[str, ...]:
        return tuple(a for a in as_tuple(entry) if mesh_shape.get(a, 1) > 1)

    token_axes, tokens_spec = _token_split(rules, mesh_shape)
    stored = rules.spec(logical, "param", "embedding table")
    used = rules.spec(logical, "activation", "embedding table")
    split, vocab = split_over(stored[1]), split_over(stored[0])
    if not split or not set(split) <= token_axes or set(vocab) & token_axes:
        return None
    if used[1] is not None or vocab != split_over(used[0]):
        return None
    if any(n % ways(mesh_shape, as_tuple(e)) for n, e in zip(shape_BT, tokens_spec, strict=True)):
        return None  # a shard_map needs whole blocks; the gathered path takes any shape
    rows = shape_VD[0] // ways(mesh_shape, vocab)
    tokens = math.prod(shape_BT) // ways(mesh_shape, token_axes)
    if 2 * microbatches * tokens >= (microbatches + 1) * rows:
        return None
    summed = tuple(sorted(token_axes - set(split)))
    return Route(split, vocab, summed, tokens_spec, rows, tokens)


def routed_table(abstract_params, rules, mesh_shape, tokens_BT, microbatches) -> Route | None:
    """How a model's embedding table is looked up on this layout, for `tokens_BT` tokens in
    each of `microbatches` (the planner's pricing of `lookup`): its Route, or None where it is
    gathered
    (no table, a table that is also the head, or a pipeline: its stages look up inside their
    shard_map, where the table is gathered)."""
    if mesh_shape.get("pipeline", 1) > 1:
        return None
    tables = {}
    for var in variables(abstract_params):
        logical = logical_axes(var)
        tables[tuple(n for n in logical if n is not None)] = (var, logical)
    if ("vocab", "embed") not in tables or ("embed", "vocab") not in tables:
        return None  # no table, or no head of its own: the table is the head, tied
    var, logical = tables[("vocab", "embed")]
    return routing(rules, mesh_shape, var.shape, tokens_BT, logical, microbatches)


def _routed(table_VD, ids_BT, logical, route: Route, here) -> jax.Array:
    """`lookup` along `route`: the rows forward, the table's gradient in its stored layout
    backward, each a shard_map over the token and vocabulary axes."""
    rules, mesh = active()
    n = ways(mesh.shape, route.split)
    psum = functools.partial(summed_on, mesh.devices.flat[0].platform, jax.lax.psum)
    table_spec = PartitionSpec(route.vocab or None, route.split)
    names = set(route.split) | set(route.vocab) | set(route.summed)
    names |= {a for entry in route.tokens_spec for a in as_tuple(entry)}
    shard = functools.partial(jax.shard_map, mesh=mesh, axis_names=names, check_vma=False)

    def forward(table_VD, ids_BT):
        ids_NBT = jax.lax.all_gather(ids_BT, route.split, axis=0)  # the group's tokens
        local_NBT = _local_rows(ids_NBT, route.vocab, route.rows)
        x_NBTD = jnp.take(table_VD, local_NBT, axis=0, mode="fill", fill_value=0)
        # Piece j (device j's tokens in this D slice) goes to device j; piece i back from
        # device i is this device's tokens in D slice i.
        x_NBTD = jax.lax.all_to_all(x_NBTD, route.split, 0, 0)
        x_BTD = jnp.moveaxis(x_NBTD, 0, -2).reshape(*ids_BT.shape, -1)
        return psum(x_BTD, route.vocab) if route.vocab else x_BTD

    def backward(ids_BT, g_BTD):
        ids_NBT = jax.lax.all_gather(ids_BT, route.split, axis=0)
        g_NBTD = jnp.moveaxis(g_BTD.reshape(*g_BTD.shape[:-1], n, -1), -2, 0)
        g_NBTD = jax.lax.all_to_all(g_NBTD, route.split, 0, 0)
        g_VD = jnp.zeros((route.rows, g_NBTD.shape[-1]), g_BTD.dtype)
        g_VD = g_VD.at[_local_rows(ids_NBT, route.vocab, route.rows)].add(g_NBTD, mode="drop")
        return psum(g_VD, route.summed) if route.summed else g_VD

    x_spec = PartitionSpec(*route.tokens_spec, None)
    run = shard(forward, in_specs=(table_spec, route.tokens_spec), out_specs=x_spec)
    back = shard(backward, in_specs=(route.tokens_spec, x_spec), out_specs=table_spec)

    @jax.custom_vjp
    def take(table_VD, ids_BT):
        return run(table_VD, ids_BT)

    def grad(ids_BT, g_BTD):
        with activation_rules(*here):
            return constrain(back(ids_BT, g_BTD), logical, "param"), None

    take.defvjp(lambda t, i: (take(t, i), i), grad)
    return take(table_VD, ids_BT)


def _token_split(rules, mesh_shape, manual=frozenset()) -> tuple[set[str], PartitionSpec]:
    """The mesh axes tokens are split over (but `manual` ones) and the token ids' spec over
    them."""
    names = rules.mesh_axes("batch", "activation") + rules.mesh_axes("seq", "activation")
    token_axes = {a for a in names if mesh_shape.get(a, 1) > 1 and a not in manual}
    spec = rules.spec(("batch", "seq"), "activation", "token ids")
    return token_axes, PartitionSpec(*(_only(entry, token_axes) for entry in spec))


def _local_rows(ids, vocab_axes: tuple[str, ...], rows: int):
    """`ids` as indices into this device's `rows` of the table (the vocabulary split over
    `tensor`): ids outside them index past the end, read as zeros and dropped from sums."""
    if not vocab_axes:
        return ids
    first = position(vocab_axes) * rows
    return jnp.where((ids >= first) & (ids < first + rows), ids - first, rows)


def summed_on(platform: str, reduce, g: jax.Array, *args, **kwargs) -> jax.Array:
    """`reduce(g, *args, **kwargs)` (a psum or reduce-scatter inside this module's shard_maps),
    in float32 on CPU where `g` is bfloat16, cast back. XLA:CPU sums bf16 collectives in f32
    anyway (its AllReducePromotion pass), but that pass rebuilds the reducer from its root's
    opcode, and in a shard_map manual over only some mesh axes the reducer's add carries a
    sharding annotation, so its root is a copy: the compile aborts the process ("Invalid binary
    instruction opcode copy"; experiments/xla_cpu_bf16_repro.py). Summing in f32 here is what
    the pass would have done; other platforms sum bf16 as it is, half the bytes."""
    if platform != "cpu" or g.dtype != jnp.bfloat16:
        return reduce(g, *args, **kwargs)
    return reduce(g.astype(jnp.float32), *args, **kwargs).astype(g.dtype)


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
