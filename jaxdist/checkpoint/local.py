"""A fast node-local checkpoint tier beside the persistent one: each process keeps its own shards.

Each process copies its addressable shards to host (each distinct shard once, not its replicas)
and one background thread writes them to `DIR/process-<index>/<step>/` on node-local storage:
a raw file per shard, then `record.json` (step, meta, process index and count, mesh shape, each
leaf's path, shape and dtype, each shard's index, device ids and crc32, and the state's
fingerprint as jaxdist.checkpoint.store computes it), all fsynced, written as `<step>.tmp-<pid>`
and renamed: a save cut short is never listed (the next LocalTier removes it). Of the committed
steps the newest `keep` stay, older ones going only once a newer one has committed; steps above
the one just committed go too: they belong to a timeline the run left (it resumed or rolled
back below them). A state holding NaN/Inf is not committed, as in the persistent tier.

Trusted only when proven, restored bitwise: every shard's size and crc32, then the restored
state's fingerprint, are checked; a failure on any process raises LocalDamaged on all, and
nothing is deleted or renamed. Not covered, so `newest_common` returns None or an older step
and logs why: a replaced node or wiped tmpfs (its shards are gone); another process count, mesh
shape or sharding (its devices need shard indices not recorded). Two runs sharing a directory
and a layout look alike: `accept` tests each record's meta. A write error (ENOSPC) never stops
the run: it is logged as a warning and kept in `last_error`; the tier retries at the next save,
and after n failures in a row skips the next 2**(n-1) - 1 saves (at most 31): a disk that stays
full warns at saves 1, 2, 4, 8, 16, 32, then every 32nd.
"""

import concurrent.futures
import json
import logging
import os
import pathlib
import shutil
import time
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxdist.checkpoint.store import _fingerprint, fingerprint
from jaxdist.checkpoint.writefail import make_dir
from jaxdist.cluster.join import local_value

log = logging.getLogger("jaxdist.checkpoint")
RECORD = "record.json"
FORMAT = 1
MAX_SKIP = 31


class LocalDamaged(Exception):
    """A local checkpoint proven damaged: a missing or truncated file, a checksum or fingerprint
    mismatch, an unreadable record (on this process or another)."""


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _mesh_shape(tree) -> dict[str, int] | None:
    for x in jax.tree.leaves(tree):
        mesh = getattr(x.sharding, "mesh", None)
        if mesh is not None:
            return {str(k): int(v) for k, v in mesh.shape.items()}
    return None


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))) == 1)


def _host_copy(state) -> list[dict]:
    """Each leaf's path, shape, dtype and distinct addressable shards, copied to host."""
    leaves = []
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        shards: dict[tuple, dict] = {}
        for shard in x.addressable_shards:
            key = _key(shard.index, x.shape)
            if key in shards:
                shards[key]["devices"].append(shard.device.id)
                continue
            shard.data.copy_to_host_async()  # all transfers in flight before the first wait
            shards[key] = {"index": key, "devices": [shard.device.id], "data": shard.data}
        leaf = dict(path=jax.tree_util.keystr(path), shape=list(x.shape), dtype=str(x.dtype))
        leaves.append(leaf | {"shards": list(shards.values())})
    for leaf in leaves:
        for s in leaf["shards"]:
            host = np.asarray(s["data"])
            # On a CPU that is a view of the device buffer, which the next step may donate.
            s["data"] = host.copy() if s["data"].device.platform == "cpu" else host
    return leaves


def _write_file(path: pathlib.Path, data: np.ndarray) -> int:
    """Writes the array's bytes and fsyncs them; their crc32."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return zlib.crc32(raw)


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unusable(record: dict, usable_for) -> str | None:
    """Why the record's shards cannot make this process's part of `usable_for` (None: they can)."""
    if record.get("format") != FORMAT:
        return f"format {record.get('format')} is not {FORMAT}"
    if record["process_count"] != jax.process_count():
        return f"written by {record['process_count']} processes, this run has {jax.process_count()}"
    if record["mesh"] != _mesh_shape(usable_for):
        return f"written for mesh {record['mesh']}, this run's is {_mesh_shape(usable_for)}"
    flat = jax.tree_util.tree_flatten_with_path(usable_for)[0]
    if [jax.tree_util.keystr(p) for p, _ in flat] != [leaf["path"] for leaf in record["leaves"]]:
        return "written for a state of other leaves"
    for (_, a), leaf in zip(flat, record["leaves"], strict=True):
        if list(a.shape) != leaf["shape"] or str(a.dtype) != leaf["dtype"]:
            return f"{leaf['path']} was {leaf['dtype']}{leaf['shape']}, is {a.dtype}{a.shape}"
        held = {tuple(map(tuple, s["index"])) for s in leaf["shards"]}
        needed = {
            _key(i, a.shape) for i in a.sharding.addressable_devices_indices_map(a.shape).values()
        }
        if not needed <= held:
            return f"{leaf['path']} is sharded otherwise (shard {sorted(needed - held)[0]} missing)"
    return None


class LocalTier:
    """Saves to and restores from this process's own folder of a node-local directory."""

    def __init__(self, directory: pathlib.Path, keep: int = 2):
        self.folder = pathlib.Path(directory).absolute() / f"process-{jax.process_index()}"
        self.keep = keep
        make_dir(
            self.folder,
            "local checkpoint directory",
            "pass a writable --local-checkpoint-dir (node-local disk or tmpfs)",
        )
        for stale in self.folder.glob("*.tmp-*"):  # a save cut short: never committed
            shutil.rmtree(stale, ignore_errors=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="local-ckpt")
        self._pending: concurrent.futures.Future | None = None
        self._failures = 0  # write failures in a row
        self._skip = 0  # saves still to skip after them
        self.last_error: str | None = None

    def steps(self) -> list[int]:
        return sorted(
            int(p.name)
            for p in self.folder.iterdir()
            if p.name.isdigit() and (p / RECORD).is_file()
        )

    def save(self, step: int, state, meta: dict) -> float:
        """Starts a save; returns the seconds the caller was blocked (the previous save, then
        the device-to-host copy). Every process must call it at the same steps: the fingerprint
        is a collective."""
        t0 = time.perf_counter()
        self.wait()
        if self._skip:
            self._skip -= 1
            _fingerprint(state)  # every process launches the same collectives, skipping or not
            return time.perf_counter() - t0
        leaves = _host_copy(state)
        fp = _fingerprint(state)  # after the copy: the two do not compete while the loop waits
        record = dict(format=FORMAT, step=step, meta=meta, mesh=_mesh_shape(state))
        record |= dict(process_index=jax.process_index(), process_count=jax.process_count())
        self._pending = self._pool.submit(self._write, step, leaves, fp, record)
        return time.perf_counter() - t0

    def wait(self) -> None:
        """Waits for the save in flight; reports (never raises) one that could not be written."""
        if self._pending is None:
            return
        outcome, self._pending = self._pending.result(), None
        if outcome is None:
            self._failures = 0
        elif outcome.startswith("non-finite"):
            log.warning("local checkpoint not saved: %s", outcome)
        else:
            self._failures += 1
            self._skip = min(2 ** (self._failures - 1) - 1, MAX_SKIP)
            self.last_error = outcome
            then = f"skipping the next {self._skip} local saves" if self._skip else "retrying"
            fix = "free space there or pass another --local-checkpoint-dir"
            log.warning("%s; the persistent checkpoints go on, %s (%s)", outcome, then, fix)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def discard(self) -> None:
        """Removes this process's folder, then the run's once no other process's is left in
        it (the user's --local-checkpoint-dir stays). Call after `close`."""
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.folder.parent.rmdir()
        except OSError:  # another process's folder is still there: its own discard removes it
            pass

    def _write(self, step: int, leaves: list[dict], fp, record: dict) -> str | None:
        """The background half of a save; what went wrong, or None once committed."""
        tmp = self.folder / f"{step}.tmp-{os.getpid()}"
        try:
            record["fingerprint"] = local_value(fp).astype(np.float64).tolist()
            if not np.all(np.isfinite(record["fingerprint"])):
                return f"non-finite: step {step}'s state holds NaN/Inf"
            tmp.mkdir()
            for i, leaf in enumerate(leaves):
                for j, s in enumerate(leaf["shards"]):
                    data = s.pop("data")
                    s["file"] = f"{i}.{j}.bin"
                    s["nbytes"] = data.nbytes
                    s["crc32"] = _write_file(tmp / s["file"], data)
            record["leaves"] = leaves
            with open(tmp / RECORD, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            self._commit(step, tmp)
            return None
        except Exception as e:  # noqa: BLE001 - the local tier must never stop the run
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(e, OSError):
                log.debug("local checkpoint write failed", exc_info=True)
            return f"local checkpoint step {step} could not be written to {self.folder}: {e}"

    def _commit(self, step: int, tmp: pathlib.Path) -> None:
        """Renames the written folder into place, then drops what it supersedes."""
        final = self.folder / str(step)
        old = self.folder / f"{step}.tmp-{os.getpid()}-old"
        if final.exists():  # the same step from a timeline the run left
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.folder)
        shutil.rmtree(old, ignore_errors=True)
        kept = [s for s in self.steps() if s <= step][-self.keep :]
        for s in self.steps():
            if s not in kept:
                shutil.rmtree(self.folder / str(s), ignore_errors=True)

    def read_meta(self, step: int) -> dict:
        return self._record(step)["meta"]

    def _record(self, step: int) -> dict:
        path = self.folder / str(step) / RECORD
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise LocalDamaged(f"local checkpoint record {path} is unreadable: {e}") from None

    def newest_common(self, usable_for, accept=None) -> int | None:
        """The newest step every process holds, written for this layout (`usable_for`: the
        abstract state of this run) from the same save, and whose meta passes `accept`. A
        collective: every process must call it."""
        mine = []
        for step in reversed(self.steps()):
            try:
                record = self._record(step)
                why = _unusable(record, usable_for)
            except (LocalDamaged, KeyError, TypeError) as e:
                why = f"its record is unreadable ({e})"
            if why is None and accept is not None and not accept(record["meta"]):
                why = "its meta is not this run's"
            if why is not None:
                if not mine:  # said of the steps newer than the newest usable one
                    log.warning("local checkpoint %s unusable: %s", self.folder / str(step), why)
                continue
            same_save = zlib.crc32(np.asarray(record["fingerprint"]).tobytes()) & 0x7FFFFFFF
            mine.append((step, same_save))
        if jax.process_count() == 1:
            return mine[0][0] if mine else None
        longest = int(np.max(multihost_utils.process_allgather(np.int32(len(mine)))))
        if longest == 0:
            return None
        padded = np.full((longest, 2), -1, np.int32)
        padded[: len(mine)] = mine
        every = multihost_utils.process_allgather(padded)  # [processes, longest, 2]
        common = set.intersection(*({tuple(map(int, r)) for r in p if r[0] >= 0} for p in every))
        newest = max((s for s, _ in common), default=None)
        if mine and newest != mine[0][0]:
            log.warning(
                "local checkpoint step %d is not held by every process (a lost node's local "
                "tier?); using %s",
                mine[0][0],
                f"local step {newest}" if newest is not None else "the persistent tier",
            )
        return newest

    def _read(self, step: int, abstract_state):
        record = self._record(step)
        why = _unusable(record, abstract_state)
        if why is not None:
            raise LocalDamaged(f"local checkpoint {self.folder / str(step)}: {why}")
        flat, treedef = jax.tree_util.tree_flatten(abstract_state)
        out = []
        for a, leaf in zip(flat, record["leaves"], strict=True):
            by_key = {tuple(map(tuple, s["index"])): s for s in leaf["shards"]}
            host: dict[tuple, np.ndarray] = {}
            arrays = []
            for device, index in a.sharding.addressable_devices_indices_map(a.shape).items():
                key = _key(index, a.shape)
                if key not in host:
                    host[key] = self._read_shard(step, by_key[key], a.dtype, key)
                arrays.append(jax.device_put(host[key], device))
            out.append(jax.make_array_from_single_device_arrays(a.shape, a.sharding, arrays))
        return jax.tree_util.tree_unflatten(treedef, out), record

    def _read_shard(self, step: int, shard: dict, dtype, key) -> np.ndarray:
        path = self.folder / str(step) / shard["file"]
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise LocalDamaged(f"local checkpoint file {path} is unreadable: {e}") from None
        if len(raw) != shard["nbytes"]:
            raise LocalDamaged(
                f"local checkpoint file {path} is truncated ({len(raw)} of {shard['nbytes']} bytes)"
            )
        if zlib.crc32(raw) != shard["crc32"]:
            raise LocalDamaged(f"local checkpoint file {path} fails its checksum")
        return np.frombuffer(raw, dtype).reshape([b - a for a, b in key])

    def restore(self, step: int, abstract_state):
        """This process's shards of `step`, verified, as global arrays laid out as
        `abstract_state`; raises LocalDamaged on every process if any process's read fails.
        A collective: every process must call it."""
        try:
            state, record = self._read(step, abstract_state)
            error = None
        except Exception as e:  # noqa: BLE001 - any failed read means a fallback, everywhere
            error = e if isinstance(e, LocalDamaged) else LocalDamaged(f"{type(e).__name__}: {e}")
        if not _everywhere(error is None):
            raise error or LocalDamaged(
                f"local checkpoint step {step} failed to read on another process"
            )
        fp = fingerprint(state)
        want = np.asarray(record["fingerprint"])
        ok = fp.shape == want.shape and np.allclose(fp, want, rtol=1e-4, atol=1e-3)
        if not _everywhere(ok):
            where = self.folder if not ok else "another process's local tier"
            raise LocalDamaged(f"local checkpoint step {step} in {where} fails its fingerprint")
        return state
