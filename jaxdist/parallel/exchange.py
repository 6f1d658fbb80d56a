"""How the replica groups' weights travel over the `replica` axis at an outer step: in the sync
type (float32, bfloat16, or 8 bits with a float32 scale per row), from each group onto the
device that owns a piece of the outer state (`up`: an all-to-all, summed there in float32) and
from the owners back to every group (`down`: an all-gather). jaxdist.parallel.replica decides
what travels and when; this module, only how.
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "replica"
EIGHT_BIT = {"int8": (jnp.int8, 127.0), "float8": (jnp.float8_e4m3fn, 448.0)}


def group_spec(spec: PartitionSpec) -> PartitionSpec:
    """A group-stacked leaf [M, ...]: one group's per device row of `replica`."""
    return PartitionSpec(AXIS, *spec)


def _quantized(x, dtype: str):
    """x as it travels: in the sync type (its bits as unsigned integers, so that XLA, allowed
    excess precision, cannot fold the cast and its inverse away and send float32), with a
    float32 scale per row (last dim) for the 8-bit types."""
    if dtype == "float32":
        return x.astype(jnp.float32), None
    if dtype == "bfloat16":
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16), None
    kind, top = EIGHT_BIT[dtype]
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    q = x / scale
    q = jnp.clip(jnp.round(q), -top, top) if dtype == "int8" else q
    return jax.lax.bitcast_convert_type(q.astype(kind), jnp.uint8), scale


def _dequantized(q, scale, dtype: str):
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
    q, scale = _quantized(x_M, dtype)
    here, there = group_spec(spec), PartitionSpec(None, *owner)
    q, scale = _moved(q, mesh, here, there), _moved(scale, mesh, _rows(here), _rows(there))
    return jnp.mean(_dequantized(q, scale, dtype), axis=0)


def down(x, spec: PartitionSpec, owner: PartitionSpec, dtype: str, mesh: Mesh):
    """The owners' x, in the sync type, to every group (an all-gather over `replica`)."""
    q, scale = _quantized(x, dtype)
    q = _moved(q, mesh, owner, spec)
    scale = _moved(scale, mesh, _rows(owner), _rows(spec))
    return _dequantized(q, scale, dtype)
