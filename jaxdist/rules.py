"""Logical-axis rules: one table per mesh preset, checked at startup, resolved to shardings.

A table row maps one logical axis to the mesh axes it is split over, once for parameters and
once for activations (FSDP splits `embed` of a weight over `fsdp` while the activations split
`batch` over it). Sharding enters through three doors, all here: parameter creation
(`state_shardings`), batch placement (`batch_sharding`) and activation constraints
(`constrain`).
"""

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.errors import ConfigError
from jaxdist.layout import REPLICA, AxisRules, MeshAxes, as_tuple, ways


def check_divisible(
    what: str,
    shape: tuple[int, ...],
    logical: tuple[str | None, ...],
    spec: PartitionSpec,
    mesh: Mesh,
) -> None:
    """Each dim must split evenly over its mesh axes, else the layout is silently uneven."""
    if len(shape) != len(logical):
        raise ConfigError(f"{what}: shape {shape} has {len(shape)} dims but logical axes {logical}")
    for dim, name, axes in zip(shape, logical, spec, strict=True):
        axes_t = as_tuple(axes)
        n = ways(mesh.shape, axes_t)
        if dim % n:
            raise ConfigError(
                f"{what}: dimension {name!r} of size {dim} is not divisible by mesh axes "
                f"{'x'.join(axes_t)} (size {n}); pick a mesh whose {'x'.join(axes_t)} size "
                f"divides {dim}, or change the model size"
            )


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def variables(state: nnx.State) -> list[nnx.Variable]:
    """The parameters of a model state as Variables, each carrying its `logical_axes`."""
    return jax.tree.leaves(state, is_leaf=is_variable)


def logical_axes(var: nnx.Variable) -> tuple[str | None, ...]:
    return tuple(var.get_metadata().get("logical_axes") or ())


def local_elements(
    shape, logical, rules: AxisRules, mesh_shape: Mapping[str, int], kind: str
) -> float:
    """Elements of one device's share of a tensor, laid out for storage ("param") or use."""
    axes = {a for n in logical if n is not None for a in rules.mesh_axes(n, kind)}
    return math.prod(shape) / ways(mesh_shape, axes)


def state_shardings(state: nnx.State, rules: AxisRules, mesh: Mesh) -> nnx.State:
    """NamedShardings for every parameter, from each Variable's `logical_axes` metadata.

    Checks each parameter against the table and the mesh first, so an impossible layout fails
    here, by name, before anything is compiled.
    """

    def one(path, var):
        what = "parameter " + "/".join(str(getattr(k, "key", k)) for k in path)
        logical = var.get_metadata().get("logical_axes")
        if logical is None:
            raise ConfigError(f"{what} declares no logical_axes; every parameter must")
        spec = rules.spec(tuple(logical), "param", what)
        check_divisible(what, tuple(var.shape), tuple(logical), spec, mesh)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=is_variable)


def batch_sharding(rules: AxisRules, mesh: Mesh, groups: bool = False) -> NamedSharding:
    """Where a [batch, seq + 1] token batch lives: split over the activation `batch` axes
    (with replica `groups`, over `replica` first: group r's rows are the r-th block). The
    sequence is split (context parallelism) only once inputs and targets are cut from it."""
    spec = rules.spec(("batch", None), "activation", "token batch")
    if groups:
        spec = PartitionSpec((REPLICA, *as_tuple(spec[0])), *spec[1:])
    return NamedSharding(mesh, spec)


def batch_ways(sharding: NamedSharding) -> int:
    """How many devices share the batch (rows per device = batch / this)."""
    return ways(sharding.mesh.shape, as_tuple(sharding.spec[0]))


# The activation-constraint door. Models call `constrain` with logical names; the trainer
# enters `activation_rules` once around tracing, with the step's whole Layout. A thread-local is
# the price of keeping mesh names out of models; `constrain` refuses to run outside it rather
# than silently not shard.
_ACTIVE = threading.local()


@contextlib.contextmanager
def activation_rules(layout, mesh: Mesh) -> Iterator[None]:
    """Trace under `layout` (a jaxdist.layout.Layout: the rule table, the step's settings such
    as how attention crosses a sequence split and the microbatches, the batch's shape) over
    `mesh`. Whatever re-enters it later (a custom VJP's backward traced after the caller's
    context closed) passes the same value back: `with activation_rules(*entered())`."""
    previous = getattr(_ACTIVE, "value", None)
    _ACTIVE.value = (layout, mesh)
    try:
        yield
    finally:
        _ACTIVE.value = previous


def entered() -> tuple:
    """(layout, mesh) the step is being traced under, to re-enter with."""
    value = getattr(_ACTIVE, "value", None)
    if value is None:
        raise RuntimeError(
            "jaxdist sharding helpers called outside activation_rules(layout, mesh); wrap the "
            "model call (or the jit tracing of the step) in that context"
        )
    return value


def active_layout():
    """The jaxdist.layout.Layout the step is being traced under."""
    return entered()[0]


def current_layout():
    """The Layout being traced under, or None outside activation_rules: for what a model may
    also be built or called without (FP8 projections are off there, jaxdist.kernels.fp8)."""
    value = getattr(_ACTIVE, "value", None)
    return None if value is None else value[0]


def active() -> tuple[AxisRules, Mesh]:
    """The rules and mesh the step is being traced under."""
    layout, mesh = entered()
    return layout.rules, mesh


def constrain(x: jax.Array, logical: tuple[str | None, ...], kind: str = "activation") -> jax.Array:
    """x laid out as the rules say for these logical axes: as an activation, or ("param") as
    a stored parameter (a weight kept in its FSDP layout where a model uses it)."""
    rules, _ = active()
    return pin(x, rules.spec(logical, kind, f"{kind} {logical}"))


def pin(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """x laid out by a spec of mesh axes over the active mesh (`constrain` for a layout the
    rule table has no logical names for)."""
    _, mesh = active()
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if manual:  # inside a shard_map: its manual axes are already split, per device
        spec = PartitionSpec(*(_without(entry, manual) for entry in spec))
        # The context's abstract mesh (those axes Manual), not the concrete all-Auto one: a
        # value carrying the latter fails jnp's mesh check when broadcast against another
        # (the padded-vocabulary mask of the loss inside a pipeline stage did).
        mesh = jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def gathered(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    """A weight used gathered (laid out as an activation: split over the tensor axes only)
    whose gradient comes back in its stored layout. Pinned gathered both ways, XLA sums the
    whole gradient over every batch axis and then slices it (the output head's: 262 MB of
    all-reduce a step on Llama-2-7B, fsdp=8); landing in the stored layout, it is
    reduce-scattered over the FSDP axes, as the layer weights' are."""
    here = entered()

    @jax.custom_vjp
    def use(x):
        return constrain(x, logical)

    def back(_, g):
        # The transpose may be traced after the caller's activation_rules has closed (a
        # jax.grad taken outside it): the layout in force where the weight was used applies.
        with activation_rules(*here):
            return (constrain(g, logical, "param"),)

    use.defvjp(lambda x: (use(x), None), back)
    return use(x)


def position(axes: tuple[str, ...]) -> jax.Array:
    """This device's index along a split over these mesh axes (the first the major one), inside
    a shard_map manual over them: the order a PartitionSpec entry of them splits a dim in."""
    index = jnp.int32(0)
    for a in axes:
        index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return index


def _without(entry: MeshAxes, axes: set[str]) -> MeshAxes:
    kept = tuple(a for a in as_tuple(entry) if a not in axes)
    return kept[0] if len(kept) == 1 else (kept or None)


def batch_mean(x: jax.Array, axis: tuple[int, ...]) -> jax.Array:
    """The mean of an activation over its batch and sequence dims (`axis`, the first two) taken
    over the whole batch, also where their mesh axes are manual (inside the pipeline's
    shard_map each device holds its own rows, or its own part of them under `context`: the
    local means, of equal token counts, are averaged)."""
    rules, _ = active()
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    split = rules.mesh_axes("batch", "activation") + rules.mesh_axes("seq", "activation")
    axes = tuple(a for a in split if a in manual)
    mean = jnp.mean(x, axis)
    return jax.lax.pmean(mean, axes) if axes else mean


def shard_map_here(f, in_specs: tuple, out_specs):
    """`jax.shard_map(f)` over the active mesh, or, inside another shard_map (the pipeline's),
    over the axes it left automatic: the specs' already-manual axes are dropped, since each
    device holds its own slice of them already."""
    _, mesh = active()
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if not manual:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def strip(spec):
        return PartitionSpec(*(_without(entry, manual) for entry in spec))

    free = {a for a in mesh.axis_names if a not in manual}
    return jax.shard_map(
        f,
        in_specs=jax.tree.map(strip, in_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)),
        out_specs=jax.tree.map(strip, out_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)),
        axis_names=free,
        check_vma=False,
    )
