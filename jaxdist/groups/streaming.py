"""Streaming DiLoCo for groups that are jobs of their own, on host arrays: which fragment a
round syncs and when its result is applied (--sync-fragments F, --sync-delay T), and the change
as it travels (--sync-dtype), by the compiled program's own rules and functions
(jaxdist.parallel.rounds.action, replica.take / put, exchange.quantized / dequantized).

- Fragments: layer l is in fragment l % F, the weights without a layers dim in fragment 0; the
  round of fragment f ends after step s when s + 1 = f H/F (mod H) (rounds.action).
- Delay: the round's change leaves after step s and the group trains on; after step s + T it
  takes the fragment's new outer weights mixed with what it learnt meanwhile, new = mix * outer
  + (1 - mix) * own (--sync-mix; without a delay the outer weights alone).
- Dtype: each process's change travels in the sync type (bfloat16, or 8 bits with a float32
  scale per row of its piece); every group dequantizes every participant's change and sums them
  in float64, in group order: exact whatever the order, so every group and a replay of the
  records get the same bits. (The program sends the weights, not the change, in bfloat16, and
  its 8-bit outer update travels down in 8 bits too; here nothing travels down: every group
  takes the outer step itself from the same sum.)
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.layout import SyncConfig
from jaxdist.parallel import exchange, replica, rounds
from jaxdist.rules import logical_axes, variables

GATHERED = ("bfloat16", "int8", "float8")
"""The sync types whose changes travel as bytes (gathered, dequantized and summed by each
group); float32 changes are summed by the all-reduce itself (in float64)."""


class Piece(NamedTuple):
    """Where one of a process's pieces (jaxdist.groups.outer.pieces) lies: its layers dim
    (None: none) and the first layer it holds."""

    dim: int | None
    start: int


def where(params, shards) -> list[Piece]:
    """Per piece of `params` (in jaxdist.groups.outer.pieces' order: `shards(x)` gives a leaf's
    pieces), its layers dim and first layer."""
    out = []
    for var, x in zip(variables(params), jax.tree.leaves(params), strict=True):
        axes = logical_axes(var)
        dim = axes.index("layers") if "layers" in axes else None
        for shard in shards(x):
            out.append(Piece(dim, 0 if dim is None else shard.index[dim].start or 0))
    return out


def check(pieces: list[np.ndarray], places: list[Piece], F: int) -> None:
    """Each piece must hold whole strides of F layers (a pipeline stage of a multiple of F)."""
    for p, at in zip(pieces, places, strict=True):
        if F > 1 and at.dim is not None and p.shape[at.dim] % F:
            raise ConfigError(
                f"--sync-fragments {F} with --groups needs each process's share of the layers "
                f"({p.shape[at.dim]}) to divide by {F}: fewer pipeline stages, or another F"
            )


def ending(sync: SyncConfig, s: int) -> int | None:
    """The fragment whose round ends after step s (its change leaves then), or None: the
    program's schedule (rounds.action) without its delay, which here only moves the apply."""
    act = rounds.action(dataclasses.replace(sync, sync_delay=0), s)
    return act.send[0] if act else None


def next_fragment(sync: SyncConfig, s: int) -> int:
    """The fragment of the first round that ends at or after step s."""
    while (f := ending(sync, s)) is None:
        s += 1
    return f


def _local(f: int, at: Piece, F: int) -> int:
    # A piece from layer `start` on holds fragment f's layers at offsets (f - start) mod F.
    return (f - at.start) % F


def taken(pieces: list[np.ndarray], places: list[Piece], F: int, f: int) -> list[np.ndarray]:
    """Fragment f of each piece that holds part of it (replica.take, on host arrays)."""
    if F == 1:
        return list(pieces)
    out = []
    for p, at in zip(pieces, places, strict=True):
        if at.dim is not None or f == 0:
            out.append(np.asarray(replica.take(jnp.asarray(p), at.dim, F, _local(f, at, F), 0)))
    return out


def put(pieces, new, places: list[Piece], F: int, f: int) -> list[np.ndarray]:
    """`pieces` with fragment f replaced by `new` (as `taken` ordered it; replica.put)."""
    if F == 1:
        return list(new)
    out, k = [], 0
    for p, at in zip(pieces, places, strict=True):
        if at.dim is not None or f == 0:
            g = _local(f, at, F)
            out.append(
                np.asarray(replica.put(jnp.asarray(p), jnp.asarray(new[k]), at.dim, F, g, 0))
            )
            k += 1
        else:
            out.append(p)
    return out


def mixed(own: list[np.ndarray], outer: list[np.ndarray], mix: float) -> list[np.ndarray]:
    """A fragment's new weights: the outer weights, mixed with the group's own by `mix`
    (replica._taken's arithmetic, in float32)."""
    if mix >= 1:
        return [np.asarray(o, np.float32) for o in outer]
    out = []
    for w, o in zip(own, outer, strict=True):
        out.append(np.asarray(mix * jnp.asarray(o) + (1 - mix) * jnp.asarray(w), np.float32))
    return out


def applied(theta, outer, places: list[Piece], sync: SyncConfig, f: int) -> list[np.ndarray]:
    """A group's pieces after it takes fragment f's outer weights: alone without a delay, else
    mixed with its own by --sync-mix (what it learnt while the round ran)."""
    F, mix = sync.sync_fragments, sync.sync_mix if sync.sync_delay else 1.0
    own = taken(theta, places, F, f)
    return put(theta, mixed(own, taken(outer, places, F, f), mix), places, F, f)


def payload_of(change: list[np.ndarray], dtype: str) -> np.ndarray:
    """What one process sends for its change: float64 joined (summed by the all-reduce), or
    the sync type's bytes."""
    if dtype in GATHERED:
        return coded(change, dtype).payload
    return np.concatenate([c.astype(np.float64).ravel() for c in change])


def total(payloads: list[np.ndarray], shapes, dtype: str) -> np.ndarray:
    """The participants' changes summed in float64 (in group order), from their payloads."""
    if dtype in GATHERED:
        return summed(payloads, shapes, dtype)
    out = payloads[0].copy()
    for p in payloads[1:]:
        out += p
    return out


class Coded(NamedTuple):
    """A change as it travels: every piece's values in the sync type, then every piece's
    float32 row scales (8-bit types), as one byte string."""

    payload: np.ndarray  # uint8
    shapes: list[tuple[int, ...]]


def coded(change: list[np.ndarray], dtype: str) -> Coded:
    """The change (float32 pieces) in the sync type (exchange.quantized: one price for one
    quantity, the program's)."""
    values, scales = [], []
    for c in change:
        # A scalar travels as a row of one (the 8-bit types' scale is per row).
        q, scale = exchange.quantized(jnp.atleast_1d(jnp.asarray(c, jnp.float32)), dtype)
        values.append(np.asarray(q).view(np.uint8).ravel())
        if scale is not None:
            scales.append(np.asarray(scale, np.float32).view(np.uint8).ravel())
    payload = np.concatenate(values + scales) if values else np.zeros(0, np.uint8)
    return Coded(payload, [c.shape for c in change])


def decoded(payload: np.ndarray, shapes: list[tuple[int, ...]], dtype: str) -> list[np.ndarray]:
    """The float32 pieces a payload of `coded` stands for (exchange.dequantized)."""
    width = 2 if dtype == "bfloat16" else 1
    bits = np.uint16 if width == 2 else np.uint8
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    at, values = 0, []
    rows_of = [tuple(s) or (1,) for s in shapes]  # as `coded` sent them: a scalar as (1,)
    for n, shape in zip(sizes, rows_of, strict=True):
        values.append(payload[at : at + n * width].view(bits).reshape(shape))
        at += n * width
    out = []
    for v, shape, given in zip(values, rows_of, shapes, strict=True):
        scale = None
        if dtype in exchange.EIGHT_BIT:
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            scale = payload[at : at + 4 * rows].view(np.float32).reshape(*shape[:-1], 1)
            at += 4 * rows
        x = exchange.dequantized(
            jnp.asarray(v), None if scale is None else jnp.asarray(scale), dtype
        )
        out.append(np.asarray(x, np.float32).reshape(given))
    return out


def summed(payloads: list[np.ndarray], shapes, dtype: str) -> np.ndarray:
    """The participants' changes (payloads in group order), dequantized and summed in float64
    (as one joined vector, jaxdist.groups.outer.joined's order)."""
    total = None
    for p in payloads:
        vec = np.concatenate([d.astype(np.float64).ravel() for d in decoded(p, shapes, dtype)])
        total = vec if total is None else total + vec
    return total
