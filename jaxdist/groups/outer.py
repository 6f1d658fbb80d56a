"""The outer step of groups that are jobs of their own, on host arrays: each process's pieces
of the weights (its addressable shards, one per distinct index: what it holds, whoever else
holds it too), the groups' mean change applied by the same Nesterov step the compiled program
runs (jaxdist.parallel.replica.nesterov), and the pieces put back on the devices.
"""

import hashlib
from typing import NamedTuple

import jax
import numpy as np

from jaxdist.groups.streaming import put, taken
from jaxdist.layout import SyncConfig
from jaxdist.parallel.replica import nesterov
from jaxdist.parallel.rounds import outer_values


def _key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def shards(x: jax.Array) -> list:
    """x's addressable shards, one per distinct index, in device order (the same in every
    group: they run the same mesh)."""
    seen, out = set(), []
    for shard in sorted(x.addressable_shards, key=lambda s: s.device.id):
        if _key(shard.index) not in seen:
            seen.add(_key(shard.index))
            out.append(shard)
    return out


def pieces(tree) -> list[np.ndarray]:
    """This process's pieces of every leaf of `tree`, on the host."""
    return [np.array(s.data) for x in jax.tree.leaves(tree) for s in shards(x)]


def placed(like, host: list[np.ndarray]):
    """`like`'s tree with its leaves rebuilt from this process's pieces `host` (as `pieces`
    ordered them), on `like`'s devices and shardings."""
    leaves, treedef = jax.tree.flatten(like)
    out, at = [], 0
    for x in leaves:
        by_key = {}
        for shard in shards(x):
            by_key[_key(shard.index)] = host[at].astype(x.dtype)
            at += 1
        arrays = [jax.device_put(by_key[_key(s.index)], s.device) for s in x.addressable_shards]
        out.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays))
    assert at == len(host), (at, len(host))
    return treedef.unflatten(out)


def joined(parts: list[np.ndarray]) -> np.ndarray:
    """The pieces as one float64 vector (one all-reduce for all of them). In float64 the sum of
    a few groups' float32 changes is exact whatever order Gloo adds them in (short of a 2^29
    spread in magnitude), so every group, and a replay, get the same bits: in float32 the last
    bit depends on the order, and training amplifies it (by about 10x a round here)."""
    if not parts:
        return np.zeros(0)
    return np.concatenate([p.astype(np.float64).ravel() for p in parts])


def split(vec: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    out, at = [], 0
    for p in like:
        out.append(vec[at : at + p.size].reshape(p.shape))
        at += p.size
    return out


class OuterState(NamedTuple):
    """This process's pieces of the outer weights and momentum (float32), and the round."""

    params: list[np.ndarray]
    momentum: list[np.ndarray]
    round: int

    @classmethod
    def first(cls, params: list[np.ndarray], round: int = 0) -> "OuterState":
        weights = [p.astype(np.float32) for p in params]
        return cls(weights, [np.zeros_like(w) for w in weights], round)

    def parts(self, theta, places=None, F: int = 1, f: int = 0) -> list[np.ndarray]:
        """The group's change since the last outer step (DiLoCo's outer gradient) on fragment
        f, per piece, in float32 (`places`: streaming.where, needed where F > 1)."""
        own, now = self.params, [t.astype(np.float32) for t in theta]
        if F > 1:
            own, now = taken(own, places, F, f), taken(now, places, F, f)
        return [o - t for o, t in zip(own, now, strict=True)]

    def change(self, theta, places=None, F: int = 1, f: int = 0) -> np.ndarray:
        """`parts`, joined in float64 (what the all-reduce sums)."""
        return joined(self.parts(theta, places, F, f))

    def stepped(
        self, summed: np.ndarray, groups: int, sync: SyncConfig, places=None, f: int = 0
    ) -> "OuterState":
        """After a committed round of fragment f: the mean of `groups` groups' changes as the
        gradient of that fragment's outer weights and momentum."""
        F = sync.sync_fragments if places is not None else 1
        own, mom = self.params, self.momentum
        if F > 1:
            own, mom = taken(own, places, F, f), taken(mom, places, F, f)
        mean = split((summed / groups).astype(np.float32), own)
        # As resolved where the run resolved it; `auto` here decides on H and the groups.
        lr, mu = outer_values(sync, groups)
        params, momentum = [], []
        for o, d, m in zip(own, mean, mom, strict=True):
            step, m = nesterov(d, m, lr, mu)
            params.append((o - step).astype(np.float32))
            momentum.append(np.asarray(m, np.float32))
        if F > 1:
            params = put(self.params, params, places, F, f)
            momentum = put(self.momentum, momentum, places, F, f)
        return OuterState(params, momentum, self.round + 1)

    def mean(self) -> float:
        """The mean of this process's outer weights (float64): a round's check in its record."""
        return float(sum(p.astype(np.float64).sum() for p in self.params)) / max(
            1, sum(p.size for p in self.params)
        )

    def sha256(self) -> str:
        h = hashlib.sha256()
        for p in self.params:
            h.update(np.ascontiguousarray(p).tobytes())
        return h.hexdigest()
