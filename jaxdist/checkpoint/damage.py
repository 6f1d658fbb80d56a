"""What counts as a damaged checkpoint, and what a restore does with one (stage 5, recover).

A restore can fail for two kinds of reasons, and only one of them is the checkpoint's fault:
- damage, shown by the read itself: a file missing or truncated (TensorStore's NOT_FOUND,
  OUT_OF_RANGE, DATA_LOSS, a truncated compressed stream), a record that does not parse, an
  item Orbax cannot find, or contents that do not match the fingerprint saved with them. Such a
  checkpoint is set aside (renamed `<step>.damaged`, never deleted) and the next older is tried;
- anything else: out of memory, an I/O error that may pass (EIO, a stale handle, a timeout),
  permissions, a version mismatch, a bug. The checkpoint may be perfectly good, so nothing is
  touched: the run stops with one message naming the checkpoint and the error (RestoreFailed).

Setting aside a healthy checkpoint loses work for good (the resume falls back, or starts
over); stopping on a passing error costs one restart. So damage must be shown, not presumed.
"""

import errno
import json
import logging
import pathlib
import shutil

import jax

from jaxdist.checkpoint.writefail import dir_bytes
from jaxdist.errors import TrainingStopped

log = logging.getLogger("jaxdist.checkpoint")

# TensorStore's status codes (in its error messages) that say the stored bytes are wrong.
_DAMAGE_CODES = ("NOT_FOUND:", "OUT_OF_RANGE:", "DATA_LOSS:")
_DAMAGE_WORDS = ("Truncated", "was not found in the checkpoint", "Error decoding")
# OS errors that say the file is not there, as opposed to the storage failing to read it.
_MISSING = (errno.ENOENT, errno.ENOTDIR)


class RestoreFailed(TrainingStopped):
    """A checkpoint could not be read, for a reason that does not show it damaged; it was left
    as it is. The CLI prints the message as one line and exits 1."""


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def damage_shown(exc: BaseException) -> str | None:
    """How the error shows the checkpoint damaged, or None if it does not (then the error is
    the storage's, the host's or the code's, and the checkpoint may be good)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _MISSING:
            return f"a file is missing ({e.filename or e})"
        if isinstance(e, json.JSONDecodeError):
            return f"its record does not parse ({e})"
        text = str(e)
        if isinstance(e, (ValueError, KeyError)) and (
            any(code in text for code in _DAMAGE_CODES) or any(w in text for w in _DAMAGE_WORDS)
        ):
            return f"it does not read: {_first_line(text)}"
    return None


def _first_line(text: str, limit: int = 240) -> str:
    return text.strip().strip("'\"").partition("\n")[0][:limit]


def restore_failed(path: pathlib.Path, exc: BaseException, rerun: str) -> RestoreFailed:
    """The one message for a restore error that does not show the checkpoint damaged."""
    what = f"{type(exc).__name__}: {_first_line(str(exc))}"
    return RestoreFailed(
        f"checkpoint {path} could not be restored ({what}). The error does not show it damaged "
        "(an I/O error that may pass, out of memory, a version mismatch, a bug), so it and every "
        f"other checkpoint were left as they are. Fix the cause, then {rerun}"
    )


def set_aside(directory: pathlib.Path, step: int, why: str) -> pathlib.Path:
    """Renames a checkpoint shown damaged to `<step>.damaged` (or .damaged1, ...); never
    deletes it. Process 0 renames; every process logs it."""
    src = directory / str(step)
    dst = directory / f"{step}.damaged"
    n = 1
    while dst.exists():
        dst, n = directory / f"{step}.damaged{n}", n + 1
    log.warning("checkpoint %s is damaged: %s; moved to %s, falling back", src, why, dst.name)
    if jax.process_index() == 0:
        shutil.move(src, dst)
    return dst


def set_aside_steps(directory: pathlib.Path) -> list[str]:
    """The names of the checkpoints an earlier restore set aside."""
    return sorted(p.name for p in directory.glob("*.damaged*") if p.is_dir())


def list_checkpoints(directory: pathlib.Path) -> list[dict]:
    """Every step directory with its size, mesh and whether it looks complete and readable."""
    from jaxdist.errors import ConfigError

    if not directory.is_dir():
        raise ConfigError(
            f"{directory} is not a directory; pass a run directory or its checkpoints/ folder"
        )
    if (directory / "checkpoints").is_dir():
        directory = directory / "checkpoints"
    rows = []
    for path in sorted(directory.iterdir(), key=lambda p: (len(p.name), p.name)):
        if path.is_dir():
            rows.append(_row(path))
    return rows


def _row(path: pathlib.Path) -> dict:
    row = dict(name=path.name, step=None, bytes=dir_bytes(path), mesh=None, valid=False, why="")
    head = path.name.split(".")[0]
    row["step"] = int(head) if head.isdigit() else None
    if not path.name.isdigit():
        row["why"] = "set aside as damaged" if ".damaged" in path.name else "incomplete"
    elif (
        not (path / "commit_success.txt").exists() and not (path / "_CHECKPOINT_METADATA").exists()
    ):
        row["why"] = "not committed"
    else:
        try:
            meta = json.loads((path / "meta" / "metadata").read_text())
            row["mesh"] = meta.get("mesh")
            missing = [
                p for p in ("state/_METADATA", "state/manifest.ocdbt") if not (path / p).exists()
            ]
            row["valid"] = not missing
            row["why"] = f"missing {', '.join(missing)}" if missing else ""
        except (OSError, json.JSONDecodeError):
            row["why"] = "record unreadable"
    return row
