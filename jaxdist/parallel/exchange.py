"""How the replica groups' weights travel over the `replica` axis at an outer step: in the sync
type (float32, bfloat16, or 8 bits with a float32 scale per row), from each group onto the
device that owns a piece of the outer state (`up`: an all-to-all, summed there in float32) and
from the owners back to every group (`down`: an all-gather). jaxdist.parallel.replica decides
what travels and when; this module, only how.

Bucketed (`up_many`, `down_many`): the replica axis is the slow link (between slices, hosts or
buildings), where each collective pays its latency alpha (milliseconds over a WAN) before a
byte moves. One collective per leaf would pay it once per parameter array; the leaves of one
exchange travel together instead, each device's pieces flattened and joined into one buffer
per type and direction (up to BUCKET_BYTES a buffer), inside a shard_map with explicit
collectives over `replica` (XLA's partitioner, given the leaves one by one, keeps one
collective per leaf). The values, their types and the bytes are the per-leaf path's: only the
number of messages changes. A leaf whose owners do not split it the way owner_spec does (one
dim M ways more, `replica` last) takes the per-leaf path (`up`, `down`).
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.layout import REPLICA, as_tuple, ways

EIGHT_BIT = {"int8": (jnp.int8, 127.0), "float8": (jnp.float8_e4m3fn, 448.0)}
BUCKET_BYTES = 1 << 30
"""At most this many bytes one device sends in one bucket (a leaf larger travels alone). Past a
few hundred MiB a message's alpha is a small share of its time even over a WAN, while every
bucket is a buffer beside the weights: of its size going up, M times its size coming down (the
all-gather returns every group's block)."""


def group_spec(spec: PartitionSpec) -> PartitionSpec:
    """A group-stacked leaf [M, ...]: one group's per device row of `replica`."""
    return PartitionSpec(REPLICA, *spec)


def quantized(x, dtype: str):
    """x as it travels: in the sync type (its bits as unsigned integers, so that XLA, allowed
    excess precision, cannot fold the cast and its inverse away and send float32), with a
    float32 scale per row (last dim) for the 8-bit types."""
    if dtype == "float32":
        return x.astype(jnp.float32), None
    if dtype == "bfloat16":
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16), None
    scale = _scale(_row_max(x), dtype)
    return _coded(x, scale, dtype), scale


def _row_max(x):
    return jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32)


def _scale(amax, dtype: str):
    """The 8-bit types' float32 scale of rows whose largest magnitude is `amax`."""
    return jnp.where(amax > 0, amax / EIGHT_BIT[dtype][1], 1.0)


def _coded(x, scale, dtype: str):
    """x in 8 bits at `scale`, as unsigned bytes."""
    kind, top = EIGHT_BIT[dtype]
    q = x / scale
    q = jnp.clip(jnp.round(q), -top, top) if dtype == "int8" else q
    return jax.lax.bitcast_convert_type(q.astype(kind), jnp.uint8)


def dequantized(q, scale, dtype: str):
    if dtype == "bfloat16":
        q = jax.lax.bitcast_convert_type(q, jnp.bfloat16)
    elif dtype in EIGHT_BIT:
        q = jax.lax.bitcast_convert_type(q, EIGHT_BIT[dtype][0])
    return q.astype(jnp.float32) if scale is None else q.astype(jnp.float32) * scale


def pinned(x, mesh: Mesh, spec: PartitionSpec):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _moved(x, mesh: Mesh, here: PartitionSpec, there: PartitionSpec):
    """x laid out `here`, then `there`: pinned at both ends, the move is made in x's own type
    (one constraint alone lets the partitioner move the float32 value it was cast from)."""
    if x is None:
        return None
    return pinned(pinned(x, mesh, here), mesh, there)


def _rows(spec: PartitionSpec) -> PartitionSpec:
    """The spec of a per-row scale (last dim 1): the tensor's, its last dim whole."""
    return PartitionSpec(*spec[:-1], None) if len(spec) else spec


def up(x_M, spec: PartitionSpec, owner: PartitionSpec, dtype: str, mesh: Mesh):
    """The mean over groups of x_M [M, ...], on its owners: each group's piece sent in the
    sync type to the device that owns it (an all-to-all over `replica`), summed in float32."""
    q, scale = quantized(x_M, dtype)
    here, there = group_spec(spec), PartitionSpec(None, *owner)
    q, scale = _moved(q, mesh, here, there), _moved(scale, mesh, _rows(here), _rows(there))
    return jnp.mean(dequantized(q, scale, dtype), axis=0)


def down(x, spec: PartitionSpec, owner: PartitionSpec, dtype: str, mesh: Mesh):
    """The owners' x, in the sync type, to every group (an all-gather over `replica`)."""
    q, scale = quantized(x, dtype)
    q = _moved(q, mesh, owner, spec)
    scale = _moved(scale, mesh, _rows(owner), _rows(spec))
    return dequantized(q, scale, dtype)


# --- Bucketed: the leaves of one exchange in one collective per type and direction -------------


def owner_spec(
    spec: PartitionSpec, shape: tuple[int, ...], mesh_shape, avoid: int | None = None
) -> PartitionSpec:
    """`spec` split M ways more over `replica`, on the largest dim that divides (the axis added
    last: each owner's piece lies inside what its group holds, so the exchange stays on
    `replica`), not on dim `avoid` (the layers, cut into fragments); unchanged where no dim
    divides (a small leaf, reduced whole)."""
    M = mesh_shape.get(REPLICA, 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    fits = [
        d
        for d, n in enumerate(shape)
        if d != avoid and n % (ways(mesh_shape, as_tuple(entries[d])) * M) == 0
    ]
    if M == 1 or not fits:
        return PartitionSpec(*entries)
    d = max(fits, key=lambda i: shape[i])
    entries[d] = (*as_tuple(entries[d]), REPLICA)
    return PartitionSpec(*entries)


def bucket_dim(
    spec: PartitionSpec, owner: PartitionSpec, shape, mesh_shape
) -> tuple[int | None, bool]:
    """(d, alone): d the dim `owner` splits over `replica` beyond `spec` (None: the owners hold
    the leaf whole, as every group does); alone where the leaf is not laid out as owner_spec
    lays it (`replica` added last on one dim, every dim whole blocks): it then takes the
    per-leaf path (`up`, `down`), d None."""
    spec_, owner_ = [as_tuple(e) for e in spec], [as_tuple(e) for e in owner]
    if len(spec_) != len(shape) or len(owner_) != len(shape) or REPLICA in sum(spec_, ()):
        return None, True
    if any(n % ways(mesh_shape, o) for n, o in zip(shape, owner_, strict=True)):
        return None, True
    extra = [d for d in range(len(shape)) if spec_[d] != owner_[d]]
    if not extra:
        return None, False
    if len(extra) > 1 or owner_[extra[0]] != (*spec_[extra[0]], REPLICA):
        return None, True
    return extra[0], False


def _cut(x, d: int | None, M: int):
    """A device's block as M rows, row j what goes to replica j: the j-th of M slices of dim d
    (d None: all of it, to every one)."""
    if d is None:
        return jnp.broadcast_to(x.reshape(1, -1), (M, x.size))
    x = x.reshape(*x.shape[:d], M, x.shape[d] // M, *x.shape[d + 1 :])
    return jnp.moveaxis(x, d, 0).reshape(M, -1)


def _piece(shape, d: int | None, M: int) -> tuple[int, ...]:
    """The shape of one row of _cut(x of `shape`, d, M)."""
    return tuple(shape) if d is None else (*shape[:d], shape[d] // M, *shape[d + 1 :])


def _joined(rows, shape, d: int):
    """M rows, each a piece of `shape` from replica j, joined in order along dim d."""
    x = jnp.moveaxis(rows.reshape(-1, *shape), 0, d)
    return x.reshape(*shape[:d], -1, *shape[d + 1 :])


def buckets(sizes: Sequence[float]) -> list[list[int]]:
    """The places of buffers of `sizes` bytes (in order) in each bucket: joined in order while
    the bucket stays within BUCKET_BYTES, a larger one alone. The rule _bucketed sends by and
    planning.sync prices by (read at each call, so that both follow a changed BUCKET_BYTES)."""
    out: list[list[int]] = []
    size = 0.0
    for i, n in enumerate(sizes):
        if not out or size + n > BUCKET_BYTES:
            out.append([])
            size = 0.0
        out[-1].append(i)
        size += n
    return out


def _bucketed(rows: Sequence, exchange: Callable) -> list:
    """Each [r, k_i] in `rows` through `exchange` ([r, K] -> [M, K]), joined into buffers of up to
    BUCKET_BYTES: one collective a buffer; the [M, k_i] results."""
    out = []
    for places in buckets([x.size * x.dtype.itemsize for x in rows]):
        bucket = [rows[i] for i in places]
        moved = exchange(jnp.concatenate(bucket, axis=1))
        out += jnp.split(moved, np.cumsum([x.shape[1] for x in bucket])[:-1], axis=1)
    return out


def _to_owners(x):  # [M, K]: row j to replica j; row j back from replica j
    return jax.lax.all_to_all(x, REPLICA, 0, 0, tiled=True)


def _gathered(x):  # [1, K] from each replica, in order: [M, K]
    return jax.lax.all_gather(x, REPLICA, axis=0, tiled=True)


def _split_paths(shapes, specs, owners, mesh: Mesh):
    """(indices bucketed, their owner dims, indices per leaf)."""
    mesh_shape = dict(mesh.shape)
    found = [bucket_dim(*so, n, mesh_shape) for n, *so in zip(shapes, specs, owners, strict=True)]
    ok = [i for i, (_, alone) in enumerate(found) if not alone]
    return ok, [found[i][0] for i in ok], [i for i, (_, alone) in enumerate(found) if alone]


def up_many(xs_M: Sequence, specs, owners, dtype: str, mesh: Mesh) -> list:
    """`up` of every leaf in xs_M: one all-to-all over `replica` for them all (and one more for
    the 8-bit types' scales)."""
    out = [None] * len(xs_M)
    ok, dims, alone = _split_paths([x.shape[1:] for x in xs_M], specs, owners, mesh)
    for i in alone:
        out[i] = up(xs_M[i], specs[i], owners[i], dtype, mesh)
    if not ok:
        return out
    M = mesh.shape[REPLICA]
    # A scale's rows are split as its tensor's, but for the last dim (whole in a row).
    row_dims = [None if d == len(specs[i]) - 1 else d for i, d in zip(ok, dims, strict=True)]

    def travelled(blocks, split):  # each group's block [1, ...] -> [M, piece]: every group's
        split = [None if d is None else d + 1 for d in split]  # after the group dim
        moved = _bucketed([_cut(b, d, M) for b, d in zip(blocks, split, strict=True)], _to_owners)
        pieces = [_piece(b.shape, d, M)[1:] for b, d in zip(blocks, split, strict=True)]
        return [r.reshape(M, *p) for r, p in zip(moved, pieces, strict=True)]

    def body(qs, scales=None):
        qs = travelled(qs, dims)
        scales = [None] * len(qs) if scales is None else travelled(scales, row_dims)
        return [jnp.mean(dequantized(q, s, dtype), axis=0) for q, s in zip(qs, scales, strict=True)]

    coded = [quantized(xs_M[i], dtype) for i in ok]
    here = [group_spec(specs[i]) for i in ok]
    args, in_specs = ([q for q, _ in coded],), (here,)
    if dtype in EIGHT_BIT:
        args, in_specs = (*args, [s for _, s in coded]), (here, [_rows(h) for h in here])
    out_specs = [owners[i] for i in ok]
    means = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        *args
    )
    for i, mean in zip(ok, means, strict=True):
        out[i] = mean
    return out


def down_many(xs: Sequence, specs, owners, dtype: str, mesh: Mesh) -> list:
    """`down` of every leaf in xs: one all-gather over `replica` for them all (and, for the
    8-bit types, one more of the rows' largest magnitudes, from which each device makes the
    scales of the rows it receives as the sender made them)."""
    out = [None] * len(xs)
    ok, dims, alone = _split_paths([x.shape for x in xs], specs, owners, mesh)
    alone += [i for i, d in zip(ok, dims, strict=True) if d is None]  # nothing moves
    ok, dims = [i for i in ok if i not in alone], [d for d in dims if d is not None]
    for i in alone:
        out[i] = down(xs[i], specs[i], owners[i], dtype, mesh)
    if not ok:
        return out

    def body(xs):
        if dtype not in EIGHT_BIT:
            qs, scales = [quantized(x, dtype)[0] for x in xs], [None] * len(xs)
        else:
            qs, scales = _coded_on_owners(xs, [owners[i] for i in ok], dims, dtype)
        moved = _bucketed([q.reshape(1, -1) for q in qs], _gathered)
        qs = [_joined(r, q.shape, d) for r, q, d in zip(moved, qs, dims, strict=True)]
        return [dequantized(q, s, dtype) for q, s in zip(qs, scales, strict=True)]

    new = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([owners[i] for i in ok],),
        out_specs=[specs[i] for i in ok],
        check_vma=False,
    )([xs[i] for i in ok])
    for i, x in zip(ok, new, strict=True):
        out[i] = x
    return out


def _coded_on_owners(xs, owners, dims, dtype: str):
    """The owners' blocks xs in 8 bits at their rows' scales, and the scales of the rows each
    device receives (its group's): one all-gather of every block's row maxima, each first
    reduced over the other axes its rows are split over (inside the group). A row split over
    `replica` too takes the largest of the gathered; the others are the rows of other owners."""
    maxima = []
    for x, owner in zip(xs, owners, strict=True):
        amax = _row_max(x)
        inner = tuple(a for a in as_tuple(owner[-1]) if a != REPLICA)
        maxima.append(jax.lax.pmax(amax, inner) if inner else amax)
    gathered = _bucketed([a.reshape(1, -1) for a in maxima], _gathered)
    qs, scales = [], []
    for x, amax, rows, d in zip(xs, maxima, gathered, dims, strict=True):
        rows = rows.reshape(-1, *amax.shape)
        if d == x.ndim - 1:  # a row split over `replica`: its largest anywhere
            amax = theirs = jnp.max(rows, axis=0)
        else:
            theirs = _joined(rows, amax.shape, d)
        qs.append(_coded(x, _scale(amax, dtype), dtype))
        scales.append(_scale(theirs, dtype))
    return qs, scales


# --- What travels, in bytes: the messages up_many and down_many send, for the planner --------

WIDTH = {"float32": 4, "bfloat16": 2, "int8": 1, "float8": 1}
"""Bytes a weight travels in, by sync type (_quantized)."""


def _block(shape, spec, mesh_shape) -> tuple[float, float]:
    """Elements of one device's block of a leaf laid out `spec`, and its rows (last dim)."""
    blocks = [ways(mesh_shape, as_tuple(e)) for e in spec] + [1] * (len(shape) - len(spec))
    local = float(np.prod([n / b for n, b in zip(shape, blocks, strict=True)]))
    return local, (local / (shape[-1] / blocks[-1]) if len(shape) else 1.0)


def _buffers(d: int | None, local: float, rows: float, ndim: int, dtype: str, M: int) -> dict:
    """One bucketed leaf's buffers on one device, owner dim d: per buffer, (the bytes _bucketed
    joins it by, the bytes it adds to its collective's result). up_many's payload and scales
    are [M, k] rows of _cut; down_many's a [1, k] block, M of them gathered."""
    width, eight = WIDTH[dtype], dtype in EIGHT_BIT
    # Sent to each of the M owners in full: a leaf every owner holds whole (d None), and the
    # scales of rows split over `replica` (d the last dim), each owner's rows being all of them.
    whole = M if d is None else 1
    scale_rows = M if d is None or d == ndim - 1 else 1
    out = {"up": (whole * local * width,) * 2}
    if eight:
        out["up scales"] = (4 * scale_rows * rows,) * 2
    if d is None:  # down_many: the owners hold what every group holds; nothing moves
        return out
    out["down"] = (local * width / M, local * width)
    if eight:  # the owners' rows' maxima (_coded_on_owners)
        out["down scales"] = (4 * scale_rows * rows / M, 4 * scale_rows * rows)
    return out


def messages(shapes, specs, owners, dtype: str, mesh_shape) -> dict[str, list[float]]:
    """Bytes per device of each collective over `replica` (its result: compiled.hlo's
    convention) that up_many ("all-to-all") and down_many ("all-gather") send for leaves of
    these shapes (a group's, without the group dim) laid out `specs`, owned `owners`: one a
    bucket of each kind of buffer. A leaf on the per-leaf path (bucket_dim's alone) is taken as
    one collective each way, its scales one more; which XLA's partitioner emits is not
    modelled."""
    M, width, eight = mesh_shape[REPLICA], WIDTH[dtype], dtype in EIGHT_BIT
    out: dict[str, list[float]] = {"all-to-all": [], "all-gather": []}
    joined: dict[str, list] = {"up": [], "up scales": [], "down": [], "down scales": []}
    for shape, spec, owner in zip(shapes, specs, owners, strict=True):
        d, alone = bucket_dim(spec, owner, shape, mesh_shape)
        local, rows = _block(shape, spec, mesh_shape)
        if alone:
            for kind in out:
                out[kind] += [local * width, *([4 * rows] if eight else [])]
            continue
        for name, sizes in _buffers(d, local, rows, len(shape), dtype, M).items():
            joined[name].append(sizes)
    for name, sizes in joined.items():
        kind = "all-to-all" if name.startswith("up") else "all-gather"
        for places in buckets([by for by, _ in sizes]):
            out[kind].append(sum(sizes[i][1] for i in places))
    return out
