"""Unattended restarts: each one recorded in the run directory, with its cause, for `goodput`.

Whoever restarts a failed run (`jaxdist launch --max-restarts N`, the Slurm script's loop)
appends one JSON line to RUN_DIR/restarts.jsonl before starting the next attempt:
{"time": unix seconds, "restart": k (1..N), "max_restarts": N, "cause": "...", "by": "launch"}.
The Slurm script writes the same line with printf; this file is the format's one definition
(`goodput` reads it: jaxdist.metrics.goodput.read_restarts).
"""

import json
import os
import pathlib
import signal
import time

FILE = "restarts.jsonl"
# A process's exit code says what ended it (jaxdist's own codes, then signals).
HANG_EXIT = 124  # a declared hang (jaxdist.cluster.watchdog), as timeout(1) reports one
GRACE_EXIT = 143  # a signal's save not reached within --term-grace: as if SIGTERM had killed it


def cause(process: int, code: int) -> str:
    """Why a process ended, in words: 'process 1 killed by SIGKILL', '... declared a hang'."""
    if code < 0 or code > 128 and code - 128 in signal.valid_signals():
        number = -code if code < 0 else code - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        if code == GRACE_EXIT:
            return f"process {process} exited {code}: a signal's save was not reached in time"
        return f"process {process} killed by {name}"
    if code == HANG_EXIT:
        return f"process {process} exited {code}: a hang was declared"
    return f"process {process} exited with code {code}"


def record(run_dir: str | os.PathLike, restart: int, max_restarts: int, why: str, by: str) -> None:
    path = pathlib.Path(run_dir) / FILE
    line = {
        "time": time.time(),
        "restart": restart,
        "max_restarts": max_restarts,
        "cause": why,
        "by": by,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")
