"""Stage 5, checkpoint and recover: Orbax async saves, verified restores onto any mesh.

A checkpoint holds the train state (parameters, optimizer state, and the data position as
`state.step`, since the batch of step s is a function of (seed, s)) and a JSON record: the
resolved config, rule table, mesh, parameter shapes and a fingerprint of the state. The
fingerprint (per-array sums) is checked on restore, so a damaged checkpoint that still reads is
caught; one that does not read is caught by the read. Either way the run falls back to the
previous checkpoint, and the damaged one is renamed aside (`<step>.damaged`), never deleted. A
restore error that does not show damage (out of memory, an I/O error that may pass) stops the
run instead, touching nothing (jaxdist.checkpoint.damage).

Orbax commits atomically (write to a temporary directory, then rename), so a save cut short by
a crash is never listed as a checkpoint.

A full disk: before each save the free space is compared with the size of a checkpoint (the
last one committed, or the state's bytes before there is one) and a warning given while there
is still room. A save that fails for want of space (or another file-system error), whether at
once or in Orbax's background thread (surfacing at the next save or wait), stops the run with
one message (CheckpointWriteFailed): its partial directory is removed, and every checkpoint
committed before stays for the rerun to resume from; so does a second Ctrl-C (`end_now`).
"""

import concurrent.futures
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxdist.checkpoint import abandon, damage
from jaxdist.checkpoint.writefail import (
    FULL,
    CheckpointWriteFailed,
    dir_bytes,
    human_bytes,
    make_dir,
    quiet_late_writer_callbacks,
    quiet_write_errors,
    remove_partial,
    warn_low_space,
    write_errno,
)
from jaxdist.cluster import faults as fault_injection
from jaxdist.cluster.join import local_value
from jaxdist.errors import ConfigError

log = logging.getLogger("jaxdist.checkpoint")
RERUN = "rerun the same command"  # how to resume, where the run directory is not known
# Orbax splits a replicated array's copy to the host among its replicas ("replica-parallel"),
# one device-side slice each; every new slice shape is a program compiled during the first
# save, while the loop waits (the README fine-tune's first Orbax save: 210 ms with them, 20-50
# ms without, its arrays of kilobytes). Below this size a split saves no copy time worth that.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 1 << 20


@jax.jit
def _fingerprint(state) -> jax.Array:
    return jnp.stack([jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(state)])


def fingerprint(state) -> np.ndarray:
    return local_value(_fingerprint(state)).astype(np.float64)


def _split_only_large_arrays() -> None:
    """Orbax's handler of jax.Array (in its registry, which StandardSave reads) with
    REPLICA_PARALLEL_MIN_SLICE_BYTES; all else as Orbax's default handler has it."""
    default = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(default, "_min_slice_bytes_for_replica_parallel", None):
        return  # registered already
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=vars(default).get("_array_metadata_store"),
        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES,
    )
    # Orbax warns of any override (through absl, on every run's stderr): this one is meant.
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl_log.setLevel(level)


def compile_fingerprint(abstract_state) -> concurrent.futures.Future:
    """Compiles the fingerprint for states like `abstract_state` (shapes, dtypes, shardings)
    in a thread of its own, beside the loop, so that the first save does not: tracing and
    compiling it there blocked the loop ~130 ms (60 small arrays, this 2-core host), where a
    compiled dispatch takes a few ms. The program lands in jit's cache, which
    `_fingerprint(state)` reads (for arrays of the same shardings, committed as a state's are)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fingerprint-compile")
    try:
        return pool.submit(lambda: _fingerprint.lower(abstract_state).compile())
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


class NonFiniteState(ValueError):
    """Raised inside a save's commit: a state holding NaN/Inf is never committed."""


class _RecordHandler(ocp.JsonCheckpointHandler):
    """Writes the checkpoint's JSON record inside the async commit.

    The fingerprint arrives as a future of a device array still being computed; it is fetched
    and checked here, in the background, so the loop does not wait for it. A non-finite state
    raises, and the checkpoint is never committed.
    """

    async def _save_fn(self, x, directory):
        fp = local_value(x["fingerprint"].result()).astype(np.float64)
        if not np.all(np.isfinite(fp)):
            raise NonFiniteState(f"step {x['step']}: state holds NaN/Inf; not committed")
        await super()._save_fn({**x, "fingerprint": fp.tolist()}, directory)


@ocp.args.register_with_handler(_RecordHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class _RecordSave(ocp.args.CheckpointArgs):
    item: dict | None = None


def param_shapes(params: nnx.State) -> dict[str, list[int]]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): list(x.shape) for path, x in flat}


class Restored(NamedTuple):
    state: Any
    step: int  # the checkpoint's step: the state after that step's update
    meta: dict


class Part(NamedTuple):
    """A part of a saved state, read alone (Orbax's partial restore), as a model's user reads
    a checkpoint: its weights, not the optimizer state beside them."""

    tree: dict
    """the part, abstract, keyed as the saved tree is (the state's fields by name):
    {"params": ...}"""
    first: Callable[[dict], int]
    """where the part's leaves start among the saved state's (the fingerprint's entries),
    from the saved tree's metadata (dicts by field name, None where the state holds none)"""


class Checkpointer:
    """Async saves into `directory`, keeping the newest `keep`; restores with fallback.

    A save that cannot be written raises CheckpointWriteFailed, from save() when the write
    fails at once, else from the next save(), wait() or close(), which wait for it. `rerun`:
    how the messages tell to resume (the run's directory to pass, where it has one).
    """

    def __init__(
        self,
        directory: pathlib.Path,
        keep: int = 3,
        rerun: str = RERUN,
        faults: fault_injection.Faults = fault_injection.NONE,
    ):
        self.directory = directory.absolute()
        self.rerun = rerun
        self.faults = faults
        make_dir(self.directory, "checkpoint directory", "pass a writable --run-dir")
        self._manager = self._open(keep)
        self.keep = keep
        self._pending: int | None = None  # the step of the save in flight, not yet committed
        self._failed: CheckpointWriteFailed | None = None
        self._size: int | None = None  # bytes of one committed checkpoint, measured once
        self._estimate: int | None = None  # the state's bytes, until a checkpoint is measured
        self._space_warned = 0  # the worst free-space condition warned of (0: none)
        steps = self.steps()
        if steps:
            self._size = dir_bytes(self.directory / str(steps[-1])) or None
        # Orbax logs a failed background write from its threads, traceback and all, before
        # save() or wait() here can turn it into one message.
        logging.getLogger("absl").addFilter(quiet_write_errors)
        logging.getLogger("asyncio").addFilter(quiet_write_errors)
        quiet_late_writer_callbacks()

    def _open(self, keep: int) -> ocp.CheckpointManager:
        _split_only_large_arrays()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
            create=True,
        )
        return ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, meta: dict) -> float:
        """Starts an async save; returns the seconds the caller was blocked.

        Blocks only for the device-to-host copy (and any unfinished previous save); the write,
        the fingerprint check and the commit run in the background. The fingerprint is
        dispatched once the copy is done, so the two do not compete for the device (on a CPU,
        for its cores) while the loop waits; it runs beside the next step instead.
        """
        t0 = time.perf_counter()
        self.wait()  # the previous save: committed, refused as non-finite, or failed (raises)
        self._check_space(state)
        try:
            self.faults.before_save(step)
        except OSError as e:
            raise self._fail(step, e) from e
        fingerprint = concurrent.futures.Future()
        record = {**meta, "step": step, "fingerprint": fingerprint, "saved_at": time.time()}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=_RecordSave(record))
        try:
            self._manager.save(step, args=args, force=True)
            self._pending = step
        except Exception as e:
            if write_errno(e) is None:
                raise
            raise self._fail(step, e) from e
        finally:
            # Dispatched before the caller's next step can donate the state's buffers.
            fingerprint.set_result(_fingerprint(state))
        return time.perf_counter() - t0

    def wait(self) -> bool:
        """Waits for the last save to commit; False if it was refused as non-finite.

        Raises CheckpointWriteFailed if it could not be written (and again on every later
        call: the run cannot go on saving)."""
        if self._failed is not None:
            raise self._failed
        try:
            self._manager.wait_until_finished()
        except NonFiniteState as e:
            log.warning("%s", e)
            self._manager.reload()
            self._pending = None
            return False
        except Exception as e:
            if write_errno(e) is None or self._pending is None:
                raise
            raise self._fail(self._pending, e) from e
        if self._pending is not None and self._size is None:
            self._size = dir_bytes(self.directory / str(self._pending)) or None
        self._pending = None
        return True

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()  # Orbax raises a failed save once per thread: not again here
            # Orbax's cleanup of unfinished saves runs in a thread close() does not wait for;
            # a process that ends first (a restore that stops the run) gets its traceback.
            cleanup = getattr(self._manager, "_cleanup_tmp_directory_future", None)
            if cleanup is not None:
                cleanup.result()

    def end_now(self) -> NoReturn:
        """Ends the process at once, the save in flight abandoned and its directory removed
        once no thread is left to write or commit it (jaxdist.checkpoint.abandon)."""
        abandon.end_now(self.directory, self.rerun)

    def _needed(self, state=None) -> int | None:
        """Bytes the next checkpoint takes: the last one's, or else the state's (the last
        state given, when none is)."""
        if self._size is not None:
            return self._size
        if state is not None:
            self._estimate = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state))
        return self._estimate

    def _check_space(self, state) -> None:
        """Warns, once per condition, while the next checkpoints still fit but not for long."""
        needed = self._needed(state)
        if needed and jax.process_index() == 0:
            self._space_warned = warn_low_space(
                self.directory, needed, self.keep, self._space_warned
            )

    def _fail(self, step: int, exc: BaseException) -> CheckpointWriteFailed:
        """The one message for a save that could not be written, after removing its partial
        directory (every process raises it; process 0 cleans up)."""
        code = write_errno(exc)
        self._pending = None
        if jax.process_index() == 0:
            remove_partial(self.directory, step)
        self._manager.reload()
        intact = self.steps()
        free = shutil.disk_usage(self.directory).free
        needed = self._needed()
        kept = (
            f"checkpoint{'s' * (len(intact) > 1)} {', '.join(map(str, intact))} "
            f"{'are' if len(intact) > 1 else 'is'} intact; a rerun resumes from checkpoint "
            f"{intact[-1]}"
            if intact
            else "no checkpoint was committed before it; a rerun starts from step 0"
        )
        if code in FULL:
            size = f", a checkpoint needs about {human_bytes(needed)}" if needed else ""
            short = (
                f"at least {human_bytes(needed - free)}" if needed and needed > free else "space"
            )
            oldest = (
                f" (deleting the oldest checkpoint, {self.directory / str(intact[0])}, frees "
                f"{human_bytes(needed)})"
                if len(intact) > 1 and needed
                else ""
            )
            peak = (
                f"; with --checkpoint-keep {self.keep} the run needs up to "
                f"{human_bytes((self.keep + 1) * needed)} there ({self.keep + 1} checkpoints "
                "during a save), so lower --checkpoint-keep if that does not fit"
                if needed
                else ""
            )
            cause = f"{os.strerror(code).lower()} ({human_bytes(free)} free there now{size})"
            fix = f"Free {short} there{oldest}{peak}; then {self.rerun}"
        else:
            first = str(exc).partition("\n")[0][:300]
            cause = f"{os.strerror(code).lower()} ({first})"
            fix = (
                "Fix the file system holding it (permissions, mount, hardware), then " + self.rerun
            )
        self._failed = CheckpointWriteFailed(
            f"checkpoint step {step} could not be written to {self.directory}: {cause}. Its "
            f"partial directory was removed and {kept}. {fix}"
        )
        return self._failed

    def read_meta(self, step: int) -> dict:
        return json.loads((self.directory / str(step) / "meta" / "metadata").read_text())

    def restore_latest(
        self, abstract_state, expect_shapes: dict[str, list[int]], steps: list[int] | None = None
    ) -> Restored | None:
        """The newest checkpoint (of `steps`; default: all) that reads and verifies, laid out as
        `abstract_state` says; a `Part` of the state reads that part alone.

        A checkpoint the read shows damaged is set aside and the next older tried; any other
        error raises RestoreFailed, every checkpoint left in place (jaxdist.checkpoint.damage).
        """
        for step in reversed(self.steps() if steps is None else steps):
            path = self.directory / str(step)
            try:
                self.faults.before_restore(step)
                meta = self.read_meta(step)
                if meta.get("param_shapes") != expect_shapes:
                    raise ConfigError(
                        f"checkpoint {path} was written for model "
                        f"{meta.get('config', {}).get('model', {}).get('name', '?')} with other "
                        "parameter shapes than this run's model; use another --run-dir, or the "
                        "--model and sizes it was written with"
                    )
                state, where = self._read(step, abstract_state)
                fp = fingerprint(state)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted below: damage, or stop untouched
                why = damage.damage_shown(e)
                if why is None:
                    raise damage.restore_failed(path, e, self.rerun) from e
                self._set_aside(step, why)
                continue
            want = np.asarray(meta["fingerprint"])[where : where + len(fp)]
            if fp.shape != want.shape or not np.allclose(fp, want, rtol=1e-4, atol=1e-3):
                self._set_aside(step, "its contents do not match the fingerprint saved with it")
                continue
            return Restored(state, step, meta)
        return None

    def _read(self, step: int, abstract_state) -> tuple[Any, int]:
        """The state of checkpoint `step` (or the `Part` of it), and where its leaves start
        among the saved state's."""
        if not isinstance(abstract_state, Part):
            args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            return self._manager.restore(step, args=args).state, 0
        path = self.directory / str(step) / "state"
        saved = ocp.StandardCheckpointHandler().metadata(path).tree
        part = abstract_state.tree
        args = ocp.args.PyTreeRestore(
            item=part,
            restore_args=ocp.checkpoint_utils.construct_restore_args(part),
            partial_restore=True,
        )
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(path, args=args), abstract_state.first(saved)

    def _set_aside(self, step: int, why: str) -> None:
        damage.set_aside(self.directory, step, why)
        self._manager.reload()


def restore(run_dir: str | pathlib.Path, abstract_state) -> Restored | None:
    """The newest good checkpoint of a run, laid out as `abstract_state` says (the state of a
    step built for any mesh: `Compiled.abstract_state`), or None if the run has none."""
    directory = pathlib.Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        raise ConfigError(f"{run_dir} holds no checkpoints/ directory; pass a run directory")
    checkpointer = Checkpointer(directory)
    try:
        return checkpointer.restore_latest(abstract_state, param_shapes(abstract_state.params))
    finally:
        checkpointer.close()
