"""Ending a run at once (a second Ctrl-C): the process becomes a small cleanup program.

A second SIGINT asks to stop now, without the checkpoint the first one asked for. A save may be
in flight: its Orbax temporary directory (`<step>.orbax-checkpoint-tmp-*`) is incomplete, and
its writer threads (TensorStore's, Orbax's commit thread) still run. Removing it while they run
would race them: a writer recreates the directories it writes into, and the commit thread may
rename the directory into place (the commit) while it is being removed. So the trainer first
ends every thread it has by replacing its process image (exec) with this file, run as a
script: the same process id, so the shell still waits for it and gets its exit status. With no
thread left, no write and no commit can happen any more; what is still named
`*.orbax-checkpoint-tmp*` is then proven uncommitted (a commit renames it away), and only that
is removed. A committed checkpoint is never touched. The program says what it did in one line
and exits 130 (128 + SIGINT, what a shell reports for a process ended by Ctrl-C).

Standard library only: it must start in milliseconds (`python -I -S`).
"""

import os
import pathlib
import shutil
import signal
import sys
from typing import NoReturn

TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's in-progress directories: <step>.orbax-checkpoint-tmp
EXIT_CODE = 130


def end_now(directory: pathlib.Path, rerun: str) -> NoReturn:
    """Replaces this process by the cleanup of `directory` (a checkpoints/ folder); `rerun`
    says how to resume ("rerun the same command with --run-dir DIR"). Never returns."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(directory), rerun]
    try:
        os.execv(sys.executable, argv)
    except OSError:  # no interpreter to exec: end without the cleanup (the next run does it)
        os.write(2, f"jaxdist: stopped at once (second Ctrl-C); to resume, {rerun}\n".encode())
        os._exit(EXIT_CODE)


def clean(directory: pathlib.Path) -> tuple[list[int], list[int]]:
    """Removes the directories of uncommitted saves, only those; returns their steps and the
    committed checkpoints' steps. Call only when no writer of the run is left."""
    unfinished = []
    for p in sorted(directory.glob(f"*{TMP_SUFFIX}*")):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            head = p.name.split(".")[0]
            unfinished += [int(head)] if head.isdigit() else []
    committed = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())
    return unfinished, committed


def message(unfinished: list[int], committed: list[int], rerun: str) -> str:
    removed = ""
    if unfinished:
        steps = ", ".join(map(str, unfinished))
        removed = f"; the unfinished save of step {steps} was removed"
    if committed:
        resume = f"checkpoint {committed[-1]} is the newest; to resume from it, {rerun}"
    else:
        resume = "no checkpoint was committed, so a rerun starts from step 0"
    return f"jaxdist: stopped at once (second Ctrl-C), without saving{removed}; {resume}"


def main(argv: list[str]) -> int:
    # A third Ctrl-C must not cut the cleanup short (with a traceback, at that).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    directory, rerun = pathlib.Path(argv[0]), argv[1]
    unfinished, committed = clean(directory) if directory.is_dir() else ([], [])
    # On a terminal: clear the progress bar's line and show the cursor it had hidden.
    tidy = "\r\x1b[2K\x1b[?25h" if sys.stderr.isatty() else ""
    sys.stderr.write(f"{tidy}{message(unfinished, committed, rerun)}\n")
    return EXIT_CODE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
