"""Fault injection, for the tests and the chaos study: `train --fault KIND:STEP:PROCESS[:SECONDS]`.

Kinds, each what a fleet's bad day brings, made to happen at a chosen step in a chosen process:
- kill: the process is killed by SIGKILL before step STEP (a lost host, the OOM killer);
- stall: it sleeps SECONDS before step STEP, alive but stuck (a hung host, jax issue 38503);
- term: it gets SIGTERM before step STEP (a preemption notice sent to one process);
- restore-error: its next restore of a checkpoint of step STEP or later fails with an I/O error
  (EIO, what a flaky network file system raises), the checkpoint itself intact;
- disk-full: its first save of step STEP or later fails with ENOSPC, as a full disk fails it
  (simulated: the write is refused before Orbax starts it; tests/test_disk_full.py fills a
  real one).

Each fault fires once per run: a marker file under RUN_DIR/faults/ remembers that it fired, so
the attempt that resumes after it (which replays the steps since the last checkpoint) runs on.
"""

import dataclasses
import errno
import os
import pathlib
import signal
import time

from jaxdist.errors import ConfigError

KINDS = ("kill", "stall", "term", "restore-error", "disk-full")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    process: int
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.step}-{self.process}"


def parse(spec: str) -> Fault:
    parts = spec.split(":")
    kind = parts[0]
    if kind not in KINDS:
        raise ConfigError(f"--fault {spec!r}: the kind must be one of {', '.join(KINDS)}")
    need = 4 if kind == "stall" else 3
    try:
        if len(parts) != need:
            raise ValueError
        fault = Fault(kind, int(parts[1]), int(parts[2]), float(parts[3]) if need == 4 else 0.0)
    except ValueError:
        form = "stall:STEP:PROCESS:SECONDS" if kind == "stall" else f"{kind}:STEP:PROCESS"
        raise ConfigError(f"--fault {spec!r} is not {form}, e.g. {form.lower()}") from None
    if fault.step < 0 or fault.process < 0 or fault.seconds < 0:
        raise ConfigError(f"--fault {spec!r}: step, process and seconds must be >= 0")
    return fault


class Faults:
    """This process's faults for one run; `None`-safe hooks the loop and the store call."""

    def __init__(self, specs: tuple[str, ...], run_dir: pathlib.Path | None, process: int):
        self.mine = [f for f in map(parse, specs) if f.process == process]
        self.marks = pathlib.Path(run_dir) / "faults" if run_dir is not None else None

    def _claim(self, fault: Fault) -> bool:
        """True the first time this fault fires in this run (its marker created here)."""
        if self.marks is None:
            return True
        self.marks.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marks / fault.name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, f"{time.time()}\n".encode())
        os.fsync(fd)  # a kill right after must still find the marker on the rerun
        os.close(fd)
        return True

    def _due(self, kind: str, match) -> Fault | None:
        for f in self.mine:
            if f.kind == kind and match(f) and self._claim(f):
                return f
        return None

    def before_step(self, step: int) -> None:
        at = lambda f: f.step == step  # noqa: E731
        if f := self._due("stall", at):
            os.write(2, f"fault injected: process {f.process} stalls {f.seconds:g} s\n".encode())
            time.sleep(f.seconds)
        if f := self._due("term", at):
            os.write(2, f"fault injected: SIGTERM to process {f.process}\n".encode())
            os.kill(os.getpid(), signal.SIGTERM)
        if f := self._due("kill", at):
            os.write(2, f"fault injected: SIGKILL to process {f.process}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)

    def before_save(self, step: int) -> None:
        if self._due("disk-full", lambda f: step >= f.step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (fault injected)")

    def before_restore(self, step: int) -> None:
        if self._due("restore-error", lambda f: step >= f.step):
            raise OSError(errno.EIO, os.strerror(errno.EIO) + " (fault injected)")


NONE = Faults((), None, 0)
