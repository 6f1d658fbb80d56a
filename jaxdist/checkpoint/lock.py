"""One trainer per run directory: an OS lock on RUN_DIR/.lock, held while the run writes.

Two trainers writing one run directory (a requeued job while the old one still runs, a second
terminal) would interleave their checkpoints and delete each other's; the second is refused at
once, with the holder's host, process id and start time, which the lock file records.

The lock is a POSIX record lock (`fcntl.lockf`), which the kernel drops when its process ends,
however it ends (kill -9 included); a crashed holder never blocks the next launch. Locks of
this kind belong to the process, so a process forked from the trainer (a data-loader worker)
does not inherit it and cannot keep it alive after the trainer dies. The one catch of POSIX
locks, that closing any descriptor of the file in the holding process drops the lock, is why
this module opens the file only once per lock and refuses a second lock of the same directory
in the same process without opening the file again.

On a shared file system the lock is exactly as good as the file system's locking:

* NFS: Linux sends these locks to the server, through the lock manager (lockd/statd) on NFSv3
  and in the protocol itself on NFSv4, so trainers on different nodes exclude each other. The
  lock of a node that died is released when the NFSv4 server's lease runs out (90 s by
  default), so a launch right after a node was lost may be refused until then; on NFSv3 it
  stays until that node reboots or an administrator clears it. A file system mounted with
  `nolock` or `local_lock=all|posix` keeps locks on each node: there, trainers on two nodes are
  not kept apart.
* Lustre needs the `flock` mount option for locks across nodes (`localflock`: per node only);
  where the file system refuses locks altogether, a warning says so and the run goes on
  unlocked.
* A node that lost its network without dying (a partition) keeps running while the server
  expires its lock: a new trainer elsewhere then gets the lock and both write. No lock on a
  shared file system can rule that out; fence the old job through the scheduler (scancel,
  deleting the pod) before relaunching.

When the lock is free but the file names a holder on another host, that holder is taken to be
gone and the lock is taken over, with a warning naming it, as the first line to read if the
file system turns out not to lock across nodes.

In a job of several processes that share the run, only process 0 takes the lock; the others do
nothing here.
"""

import errno
import fcntl
import json
import logging
import os
import pathlib
import socket
import threading
import time
from typing import Any

from jaxdist.errors import ConfigError

log = logging.getLogger("jaxdist.checkpoint")

LOCK_NAME = ".lock"

# Locks this process holds, by the lock file's (device, inode): POSIX locks do not exclude
# within a process, so a second lock of the same run from this process is refused here.
_held: dict[tuple[int, int], dict] = {}
_held_guard = threading.Lock()


def _since(record: dict) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(record["since"])))
    except (KeyError, TypeError, ValueError):
        return "an unknown time"


def _describe(record: dict | None) -> str:
    if not record:
        return "another process (which has not recorded itself yet)"
    return (
        f"process {record.get('pid', '?')} on host {record.get('host', '?')}, "
        f"since {_since(record)}"
    )


def _parse(data: bytes) -> dict | None:
    try:
        record = json.loads(data or b"null")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _read(path: pathlib.Path) -> dict | None:
    """The holder's record; only for a lock this process does not hold (see the docstring)."""
    try:
        return _parse(path.read_bytes())
    except OSError:
        return None


class RunLock:
    """`with RunLock(run_dir, jax.process_index()):` around everything that writes the run.

    Raises ConfigError on entry when another trainer holds the run directory; released on
    exit, whether the block ends normally or by an exception.
    """

    def __init__(self, run_dir: str | os.PathLike, process_index: int):
        self.run_dir = pathlib.Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.process_index = process_index
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None

    def __enter__(self) -> "RunLock":
        if self.process_index == 0:
            self._acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _refuse(self, holder: dict | None) -> ConfigError:
        pid = holder.get("pid") if holder else None
        stop = f"stop that process (kill {pid} on its host)" if pid else "stop that process"
        return ConfigError(
            f"run directory {self.run_dir} is in use by another trainer: {_describe(holder)} "
            f"(lock {self.path}); wait for it to finish, {stop}, or pass another --run-dir"
        )

    def _acquire(self) -> None:
        with _held_guard:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    st = os.stat(self.path)
                    if (st.st_dev, st.st_ino) in _held:  # opening it again would drop our lock
                        raise self._refuse(_held[st.st_dev, st.st_ino])
                except FileNotFoundError:
                    pass
                # The one descriptor of this file in this process; not inherited by exec'd
                # children (PEP 446), and fork does not pass a POSIX lock on.
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ConfigError(
                    f"cannot write run directory {self.run_dir}: {e.strerror}; pass a writable "
                    "--run-dir"
                ) from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    time.sleep(0.1)  # a holder that has just locked writes its record next
                    raise self._refuse(_read(self.path)) from None
                log.warning(
                    "cannot lock %s (%s): this file system has no working locks, so a second "
                    "trainer on this run directory would not be refused; make sure only one "
                    "runs",
                    self.path,
                    e.strerror,
                )
                return
            st = os.fstat(fd)
            previous = _parse(os.pread(fd, 4096, 0))  # through fd: closing another drops it
            record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)  # so that a trainer on another node reads it (NFS caches writes)
            self._fd, self._key = fd, (st.st_dev, st.st_ino)
            _held[self._key] = record
        if previous and previous.get("host") != record["host"]:
            log.warning(
                "run directory %s was held by %s, which no longer holds its lock; taking it "
                "over. If that process still runs (a file system that locks per node only), "
                "stop it now: both would write the same checkpoints",
                self.run_dir,
                _describe(previous),
            )
        elif previous:
            log.info("run directory %s: its previous trainer (%s) ended", self.run_dir, previous)

    def release(self) -> None:
        """Drops the lock and clears the record; the file stays (deleting it would race)."""
        if self._fd is None:
            return
        with _held_guard:
            try:
                os.ftruncate(self._fd, 0)
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
            except OSError:
                pass  # closing below releases it anyway
            os.close(self._fd)
            _held.pop(self._key, None)
            self._fd = self._key = None
