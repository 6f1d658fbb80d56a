"""A pipeline stage's weights, gathered once per step and their gradients reduced once.

Inside the pipeline's shard_map the batch axes (`data`, `fsdp`, `expert`: the mesh axes of the
`batch` activation rule) are manual beside `pipeline`, so the step decides where weights move
instead of the SPMD partitioner, which, in a partially manual shard_map, re-gathered FSDP
weights and reduced their gradients on every tick. Here each stage gathers its layers and the
shared weights (embedding, head, final norm) over the batch axes once, in the compute dtype,
before the first tick; every tick accumulates local gradients in the stored dtype; after the
last tick each gradient is reduce-scattered back to its shard over the axes the weight is
split over and all-reduced over the other batch axes. `tensor` stays automatic: tensor
parallelism inside a stage is the model's own (Megatron) all-reduces, per microbatch.

Pays in memory: a stage holds its gathered layers and a full-size gradient accumulator for the
whole step (ZeRO-1/2 within the stage instead of ZeRO-3), the price of moving each weight
byte twice per step instead of twice per tick. The gradient reduction moves stored-dtype bytes
(fp32) once, not compute-dtype bytes per microbatch.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdist.layout import AxisRules
from jaxdist.rules import active


def batch_axes(rules: AxisRules, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes whose devices hold other tokens (of more than one device): the batch's,
    then the sequence's (context); manual inside the pipeline, weights gathered over them once
    per step. A size-1 axis stays automatic: a collective over it would move nothing, yet it
    made the partitioner gather tensor-split weights whole before it."""
    axes = (*rules.mesh_axes("batch", "activation"), *rules.mesh_axes("seq", "activation"))
    return tuple(a for a in axes if mesh_shape.get(a, 1) > 1)


def manual_spec(logical, rules: AxisRules, manual: set[str], kind: str = "param") -> P:
    """A weight's stored PartitionSpec (or, `kind` "activation", its compute layout)
    restricted to the mesh axes `manual` (shard_map's specs name only its manual axes)."""
    dims = []
    for name in logical:
        axes = tuple(a for a in rules.mesh_axes(name, kind) if a in manual) if name else ()
        dims.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*dims)


def _dims(spec: P, axes: tuple[str, ...]) -> list[tuple[int, tuple[str, ...]]]:
    """(dimension, its mesh axes among `axes`) for every dimension split over any of them."""
    out = []
    for d, entry in enumerate(spec):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        names = tuple(a for a in names if a in axes)
        if names:
            out.append((d, names))
    return out


def _per_shard(fn, x: jax.Array, logical, rules: AxisRules, auto: tuple[str, ...]):
    """`fn` on each device's own shard over the automatic axes too (a nested shard_map over
    them): before a manual all_gather or psum_scatter, XLA 0.11's partitioner gathered a weight
    whole over `tensor`, moving tensor-times the bytes."""
    if not auto:
        return fn(x)
    spec = manual_spec(logical, rules, set(auto))
    return jax.shard_map(fn, in_specs=spec, out_specs=spec, axis_names=set(auto), check_vma=False)(
        x
    )


def _moved(logical, rules: AxisRules, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The batch axes a weight is gathered over and its gradient summed over: all but those
    its compute layout splits too (experts: each device runs its own on the tokens sent)."""
    # (A table along the sequence, GPT-2's positions, is gathered whole: the tokens a device
    # holds look up any position, their order balanced across the context split.)
    kept = {a for n in logical if n and n != "seq" for a in rules.mesh_axes(n, "activation")}
    return tuple(a for a in axes if a not in kept)


def _over_split(x, logical, rules: AxisRules, axes, auto, move) -> tuple[jax.Array, tuple]:
    """`move(x, names, dim)` for each dimension of the weight split over the batch axes it moves
    over, on each device's shard over the automatic axes; and those moved axes that split no
    dimension (the gradient's all-reduce)."""
    axes = _moved(logical, rules, axes)
    split = _dims(manual_spec(logical, rules, set(axes)), axes)

    def one(x):
        for d, names in split:
            x = move(x, names, d)
        return x

    if split:
        x = _per_shard(one, x, logical, rules, auto)
    return x, tuple(a for a in axes if all(a not in names for _, names in split))


def gather(w, logical, rules: AxisRules, axes: tuple[str, ...], auto: tuple[str, ...], dtype):
    """The whole weight over the batch axes, on every device (still split over the automatic
    axes), cast first so the gather moves compute-dtype bytes."""

    def all_gather(w, names, d):
        return jax.lax.all_gather(w, names, axis=d, tiled=True)

    return _over_split(w.astype(dtype), logical, rules, axes, auto, all_gather)[0]


def reduce(g, logical, rules: AxisRules, axes: tuple[str, ...], auto: tuple[str, ...], extra=()):
    """A local gradient summed over the batch axes (and `extra`), landing as the weight's
    shard: reduce-scattered over the axes the weight is split over, all-reduced over the rest."""

    def scatter(g, names, d):
        return jax.lax.psum_scatter(g, names, scatter_dimension=d, tiled=True)

    g, rest = _over_split(g, logical, rules, axes, auto, scatter)
    rest += tuple(extra)
    return jax.lax.psum(g, rest) if rest else g


def zeros_like_stored(tree, stored) -> dict:
    """Gradient accumulators shaped like the gathered weights, in the stored dtype."""
    return jax.tree.map(lambda w, s: jnp.zeros(w.shape, s.dtype), tree, stored)


def laid_out(tree: dict, axes: dict, lead: int = 0) -> dict:
    """Each weight (or gradient) in its compute layout over the automatic axes (`tensor`), so
    the partitioner keeps tensor-split weights split instead of gathering them whole; `lead`
    dims in front (the pipeline's chunk index) are not split."""
    rules, mesh = active()
    auto = {a for a in mesh.axis_names if a not in jax.sharding.get_abstract_mesh().manual_axes}
    # A bare PartitionSpec: it refers to shard_map's context mesh (manual axes marked), so
    # indexed updates of these arrays inside the ticks agree with it.
    return {
        k: jax.lax.with_sharding_constraint(
            w, manual_spec((None,) * lead + tuple(axes[k]), rules, auto, "activation")
        )
        for k, w in tree.items()
    }
