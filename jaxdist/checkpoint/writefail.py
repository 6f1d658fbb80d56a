"""A checkpoint that cannot be written (a full disk, mostly): warning while the disk still has
room, telling a file-system failure from a bug, keeping Orbax's threads from printing it as
tracebacks, and removing what it left. Checkpointer (jaxdist.checkpoint.store) turns such a
failure into one CheckpointWriteFailed."""

import errno
import logging
import os
import pathlib
import re
import shutil
import sys
import time

from jaxdist.checkpoint.abandon import TMP_SUFFIX
from jaxdist.errors import ConfigError, TrainingStopped

log = logging.getLogger("jaxdist.checkpoint")


class CheckpointWriteFailed(TrainingStopped):
    """A checkpoint could not be written (a full disk, mostly); the message says what to do.

    Its partial directory is removed and the checkpoints committed before stay; the CLI prints
    the message as one line and exits 1.
    """


FULL = (errno.ENOSPC, errno.EDQUOT)
# TensorStore reports OS errors in its own exceptions' text, e.g. "[os_error_code='28']".
_OS_ERROR_CODE = re.compile(r"os_error_code\W{0,3}(\d+)")


def write_errno(exc: BaseException | None) -> int | None:
    """The OS error behind a failed write (errno), looked up along the exception's causes;
    None when it is not a file-system error (a bug stays a bug, with its traceback)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        code = _write_errno_in(str(exc))
        if code is not None:
            return code
        exc = exc.__cause__ or exc.__context__
    return None


def _write_errno_in(text: str) -> int | None:
    match = _OS_ERROR_CODE.search(text)
    if match:
        return int(match.group(1))
    for code in FULL:
        if os.strerror(code) in text:
            return code
    return None


class QuietWriteErrors(logging.Filter):
    """Drops Orbax's own reports (each with a traceback) of a save that failed on a file-system
    error: Checkpointer turns that error into one CheckpointWriteFailed message instead. Also
    asyncio's report of an Orbax writer task that ended on that error after the save was
    abandoned (seen under load, at the event loop's shutdown)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = "orbax" in record.pathname or record.name == "asyncio"
        if record.levelno < logging.ERROR or not ours:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return write_errno(exc) is None and _write_errno_in(record.getMessage()) is None


quiet_write_errors = QuietWriteErrors()


def _late_writer_callback(exc: BaseException | None) -> bool:
    """TensorStore's completion callback of a write Orbax no longer awaits: after a save failed
    (on a full disk, say), Orbax's event loop is closed while the save's other writes are still
    running, and each one that ends then finds the loop closed."""
    if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
        return False
    tb = exc.__traceback__
    return tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"


def quiet_late_writer_callbacks() -> None:
    """Keeps those late callbacks (TensorStore reports them as unraisable, with a bare
    traceback, during any later step) off stderr; every other unraisable error goes on to the
    hook that was there. Installed once per process."""
    previous = sys.unraisablehook
    if getattr(previous, "jaxdist_quiet", False):
        return

    def hook(unraisable) -> None:
        if _late_writer_callback(unraisable.exc_value):
            log.debug("a write of an abandoned save ended after Orbax closed its event loop")
            return
        previous(unraisable)

    hook.jaxdist_quiet = True
    sys.unraisablehook = hook


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def dir_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def warn_low_space(directory: pathlib.Path, needed: int, keep: int, warned: int) -> int:
    """Warns while the next checkpoints of `needed` bytes still fit in `directory` but not for
    long, once per condition: `warned` is the worst one warned of so far (0: none, 1: room for
    one more, 2: not even that), and the new one is returned (0 again once space is freed)."""
    free = shutil.disk_usage(directory).free
    level = 2 if free < needed else 1 if free < 2 * needed else 0
    if level > warned and level == 2:
        log.warning(
            "only %s free in %s, less than the %s the next checkpoint needs: it will likely "
            "fail and stop the run (the checkpoints already written stay). Free space there now",
            human_bytes(free),
            directory,
            human_bytes(needed),
        )
    elif level > warned:
        log.warning(
            "only %s free in %s: room for one more checkpoint of %s; a save that does not fit "
            "stops the run. With --checkpoint-keep %d the run needs up to %s there (%d "
            "checkpoints during a save); free space there, or lower --checkpoint-keep",
            human_bytes(free),
            directory,
            human_bytes(needed),
            keep,
            human_bytes((keep + 1) * needed),
            keep + 1,
        )
    return level if level == 0 else max(level, warned)


def remove_partial(directory: pathlib.Path, step: int) -> None:
    """Removes what a failed save of `step` left. Its writer threads may still be ending, and
    one can recreate a file just removed: retried for a moment."""
    for _ in range(20):
        partial = [p for p in directory.glob(f"{step}{TMP_SUFFIX}*") if p.is_dir()]
        if not partial:
            return
        for p in partial:
            shutil.rmtree(p, ignore_errors=True)
        time.sleep(0.05)
    log.warning("could not remove %s; the next run removes it", partial[0])


def make_dir(path: pathlib.Path, what: str, fix: str) -> None:
    """Creates a directory a run writes into, or ends in one line naming it and the fix."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {what} {path}: {e.strerror}; {fix}") from None
