"""Muon's Newton-Schulz on whole matrices, without gathering each weight on every device.

A stacked weight [L, (E,) rows, cols] is stored split over its matrix dims (FSDP, tensor), and
Newton-Schulz needs whole matrices. Left to itself, XLA's partitioner runs the iteration's
matmuls on the shards and sums partial products across devices over and over (several times
all of AdamW's step: experiments/README.md, "Muon, sharded"); asked for a layout with the
layers split instead, it gathers the whole tensor first. Here each momentum moves in one
all-to-all over the mesh axes that split its matrix dims, so that every device owns whole
matrices of a slice of a batch dim (`layers`, `expert`): Newton-Schulz runs locally, and the
reverse all-to-all brings the result back, each device's share moving twice. Where no batch
dim divides among those devices (fewer layers than devices), the matrices are gathered
instead, the fallback: one all-gather in a shard_map, each device keeping its own block of the
result (pinning the gathered layout and leaving the rest to XLA let its partitioner spread the
Newton-Schulz matmuls over the devices anyway, `data` among them). The update is traced inside
jaxdist.rules.activation_rules, as the step traces it: the mesh it moves over is read there.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers, MuonState

from jaxdist.layout import AxisRules, as_tuple, ways
from jaxdist.rules import entered, is_variable, logical_axes, shard_map_here, variables

DimsOf = Callable[[tuple[str | None, ...]], MuonDimensionNumbers]
# optax.contrib.muon's default coefficients of the quintic iteration (modded-nanogpt's).
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(x, coeffs, steps: int, eps: float, dims: MuonDimensionNumbers):
    """Each matrix of x (`dims`: its reduction and output dims, the rest batch dims)
    orthogonalized as optax.contrib.muon does with its default preconditioning, whose
    iteration optax 0.2.8 names only privately: divided by its Frobenius norm, then `steps`
    times X <- c0 X + (c1 A + c2 A A) X with A = X X^T, X taken wide (transposed where it has
    more rows than columns)."""
    matrix = (*dims.reduction_axis, *dims.output_axis)
    order = (*[d for d in range(x.ndim) if d not in matrix], *matrix)
    groups = (order[: x.ndim - len(matrix)], dims.reduction_axis, dims.output_axis)
    coeffs = coeffs.astype(x.dtype)

    def one(m):
        tall = m.shape[0] > m.shape[1]
        m = m.T if tall else m
        m = m / (jnp.linalg.norm(m, ord="fro") + eps)
        for _ in range(steps):
            a = m @ m.T
            b = coeffs[1] * a + coeffs[2] * a @ a
            m = coeffs[0] * m + b @ m
        return m.T if tall else m

    flat = x.transpose(order).reshape([math.prod(x.shape[d] for d in g) for g in groups])
    y = jax.vmap(one)(flat).reshape([x.shape[d] for d in order])
    return y.transpose(sorted(range(x.ndim), key=order.__getitem__))


def batch_dim(
    stored: PartitionSpec, shape: tuple[int, ...], dims: MuonDimensionNumbers, mesh_shape
) -> int | None:
    """The batch dim (one `dims` leaves out) whose per-device slice divides among the devices
    that split the matrix dims, so each can own whole matrices of it; None: none does."""
    entries = [as_tuple(stored[d]) if d < len(stored) else () for d in range(len(shape))]
    matrix = set(dims.reduction_axis) | set(dims.output_axis)
    n = math.prod(mesh_shape[a] for d in matrix for a in entries[d])
    for d in range(len(shape)):
        local = shape[d] // math.prod(mesh_shape[a] for a in entries[d])
        if d not in matrix and n > 1 and local % n == 0:
            return d
    return None


def _moves(stored: PartitionSpec, dims: MuonDimensionNumbers) -> list[tuple[int, str]]:
    """(dim, mesh axis) of each axis splitting a matrix dim, in the spec's order (major first:
    the order a tuple of axes numbers its devices in)."""
    matrix = sorted(set(dims.reduction_axis) | set(dims.output_axis))
    return [(d, a) for d in matrix if d < len(stored) for a in as_tuple(stored[d])]


def _route(stored: PartitionSpec, shape, dims: MuonDimensionNumbers, mesh_shape):
    """(batch dim or None: the fallback, moves): how a momentum stored as `stored` reaches
    whole matrices, the one decision that both the step and its pricing (`moved`) read."""
    return batch_dim(stored, shape, dims, mesh_shape), _moves(stored, dims)


class Moved(NamedTuple):
    """One Muon weight's momentum moved in a step: `kind` over the mesh `axes` that split its
    matrix dims, `nbytes` per device (compiled.hlo's convention: an all-to-all's buffer, a
    gather's output), in `count` collectives."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    count: int


def moved(abstract_params, rules: AxisRules, mesh_shape, dims_of: DimsOf) -> list[Moved]:
    """What Newton-Schulz moves a step, weight by weight (`dims_of`: None for AdamW's): the
    all-to-all there and back, twice the stored shard; in the fallback, the gather of the
    matrices of the device's batch slice (the way back is a slice, no traffic)."""
    out = []
    for var in variables(abstract_params):
        axes = logical_axes(var)
        dims = dims_of(axes)
        if dims is None:
            continue
        stored = rules.spec(axes, "param")
        batch, moves = _route(stored, var.shape, dims, mesh_shape)
        over = tuple(a for _, a in moves if mesh_shape.get(a, 1) > 1)
        if not over:  # the matrices already lie whole on each device
            continue
        split = [a for entry in stored for a in as_tuple(entry)]
        # The momentum is stored as its weight is, in the weight's dtype.
        shard = math.prod(var.shape) / ways(mesh_shape, split) * var.get_value().dtype.itemsize
        if batch is None:
            out.append(Moved("all-gather", over, shard * ways(mesh_shape, over), 1))
        else:
            out.append(Moved("all-to-all", over, 2 * shard, 2))
    return out


def _to_owner(x, batch: int, moves: list[tuple[int, str]], sizes: list[int]):
    """Inside shard_map: this device's block of x -> whole matrices of its 1/n of the block's
    `batch` slice (n: the devices of `moves`), in one all-to-all."""
    n, rest = math.prod(sizes), [d for d in range(x.ndim) if d != batch]
    x = jnp.moveaxis(x, batch, 0)
    x = x.reshape(n, x.shape[0] // n, *x.shape[1:])
    x = jax.lax.all_to_all(x, tuple(a for _, a in moves), 0, 0)  # [source, my slice, block]
    return jnp.moveaxis(_assemble(x, rest, moves, sizes), 0, batch)


def _assemble(x, rest: list[int], moves: list[tuple[int, str]], sizes: list[int]):
    """[source, slice, block of each `rest` dim] -> [slice, whole dims]: each source's block in
    its place, a dim's block indices just before it."""
    x = x.reshape(*sizes, *x.shape[1:])
    m = len(moves)
    order = [m]
    for j, d in enumerate(rest):
        order += [k for k, (dim, _) in enumerate(moves) if dim == d] + [m + 1 + j]
    x = x.transpose(order)
    return x.reshape(x.shape[0], *_whole(x.shape[1:], rest, moves))


def _whole_matrices(x, moves: list[tuple[int, str]], sizes: list[int]):
    """Inside shard_map, the fallback: this device's block of x -> the whole matrices of its
    slice of the other dims, in one all-gather over every axis of `moves`."""
    x = jax.lax.all_gather(x, tuple(a for _, a in moves), axis=0)  # [source, block]
    return _assemble(x[:, None], list(range(x.ndim - 1)), moves, sizes)[0]


def _own_block(y, moves: list[tuple[int, str]], sizes: list[int]):
    """Inside shard_map: this device's block of whole matrices y (`_whole_matrices` undone)."""
    for d in sorted({dim for dim, _ in moves}):
        index, n = 0, 1  # the linear index over the dim's axes, major first
        for (dim, a), size in zip(moves, sizes, strict=True):
            if dim == d:
                index, n = index * size + jax.lax.axis_index(a), n * size
        block = y.shape[d] // n
        y = jax.lax.dynamic_slice_in_dim(y, index * block, block, axis=d)
    return y


def _whole(shape, rest: list[int], moves: list[tuple[int, str]]) -> list[int]:
    """Dims of `rest` each merged with the block indices that precede it in `shape`."""
    out, i = [], 0
    for d in rest:
        k = 1 + sum(1 for dim, _ in moves if dim == d)
        out.append(math.prod(shape[i : i + k]))
        i += k
    return out


def _from_owner(y, batch: int, moves: list[tuple[int, str]], sizes: list[int]):
    """`_to_owner` undone: whole matrices of a 1/n slice -> this device's block, all of it."""
    n, rest, m = math.prod(sizes), [d for d in range(y.ndim) if d != batch], len(moves)
    y = jnp.moveaxis(y, batch, 0)
    labels, split = ["b"], [y.shape[0]]
    for j, d in enumerate(rest):
        mine = [k for k, (dim, _) in enumerate(moves) if dim == d]
        labels += [("m", k) for k in mine] + [("r", j)]
        split += [sizes[k] for k in mine] + [y.shape[1 + j] // math.prod(sizes[k] for k in mine)]
    y = y.reshape(split)
    target = [("m", k) for k in range(m)] + ["b"] + [("r", j) for j in range(len(rest))]
    y = y.transpose([labels.index(t) for t in target])
    y = y.reshape(n, *y.shape[m:])
    y = jax.lax.all_to_all(y, tuple(a for _, a in moves), 0, 0)  # [slice index, slice, block]
    y = y.reshape(n * y.shape[1], *y.shape[2:])
    return jnp.moveaxis(y, 0, batch)


def _orthogonalized(x, axes, dims: MuonDimensionNumbers, coeffs, ns_steps: int, eps: float):
    """Newton-Schulz of each matrix of x, run where each device owns whole matrices."""
    layout, mesh = entered()  # outside a traced step: no mesh to move over, refused

    def ns(x, coeffs):
        return newton_schulz(x, coeffs, ns_steps, eps, dims)

    stored = layout.rules.spec(axes, "param")
    mesh_shape = dict(mesh.shape)
    batch, moves = _route(stored, x.shape, dims, mesh_shape)
    sizes = [mesh_shape[a] for _, a in moves]
    if math.prod(sizes) == 1:  # the matrices already lie whole on each device
        return ns(x, coeffs)

    def local(x, coeffs):
        if batch is None:  # the fallback: every device of `moves` orthogonalizes them all
            return _own_block(ns(_whole_matrices(x, moves, sizes), coeffs), moves, sizes)
        return _from_owner(ns(_to_owner(x, batch, moves, sizes), coeffs), batch, moves, sizes)

    return shard_map_here(local, (stored, PartitionSpec()), stored)(x, coeffs)


def scale_by_muon(
    dims_of: DimsOf, ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8
) -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon's update and state (bias-corrected Nesterov momentum,
    orthogonalized by its Newton-Schulz), each matrix orthogonalized in its owner layout.
    `dims_of(logical axes)`: the weight's matrix, as optax's dimension numbers."""

    def init(params):
        return MuonState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            ns_coeffs=jnp.asarray(NS_COEFFS),
        )

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(
            lambda m, g: beta * m + (1 - beta) * g,
            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
            optax.tree.bias_correction(updates, beta, count),
        )

        def one(var):
            axes = logical_axes(var)
            x = var.get_value()
            return var.replace(
                _orthogonalized(x, axes, dims_of(axes), state.ns_coeffs, ns_steps, eps)
            )

        updates = jax.tree.map(one, mu_hat, is_leaf=_is_array_variable)
        return updates, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init, update)


def scale_by_shape(dims_of: DimsOf) -> optax.GradientTransformation:
    """optax.contrib.muon's width scaling (its default, consistent_rms=None): the update of a
    fan_in x fan_out matrix grows by sqrt(max(1, fan_out / fan_in))."""

    def update(updates, state, params=None):
        del params

        def one(var):
            dims, x = dims_of(logical_axes(var)), var.get_value()
            fan_in = math.prod(x.shape[a] for a in dims.reduction_axis)
            fan_out = math.prod(x.shape[a] for a in dims.output_axis)
            return var.replace(jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * x)

        return jax.tree.map(one, updates, is_leaf=_is_array_variable), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _is_array_variable(x) -> bool:
    """A parameter of Muon's part of the tree (optax.partition masks the rest)."""
    return is_variable(x) and not isinstance(x.get_value(), optax.MaskedNode)
