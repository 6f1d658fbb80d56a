"""The `jaxdist` command line: the one part of jaxdist that wires models/ and meshes/ in."""

import os
import signal
import sys
import threading

STARTING = b"jaxdist: interrupted (Ctrl-C) while starting; nothing was run\n"


def _end_while_starting(signum, frame) -> None:
    # Nothing is started or written yet: ending at once is safe, and it is what the user asked.
    os.write(2, STARTING)
    os._exit(130)  # the shell's code for death by SIGINT


def _as_command() -> bool:
    """Whether this process is the `jaxdist` command (its script, or `python -m jaxdist.cli`,
    whose argv[0] is "-m" while the package loads), in its main thread, SIGINT Python's own."""
    command = os.path.basename(sys.argv[0] if sys.argv else "") in ("jaxdist", "-m")
    return (
        command
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )


# A Ctrl-C while the command's modules load (JAX's take seconds) would print the traceback of
# whichever import it interrupted, or, inside a C extension's initialization, an ImportError
# (or nothing at all: the extension swallows it). Until they are loaded, it ends the process
# with one line; then Python's KeyboardInterrupt is back, for main() to handle.
_guarded = _as_command()
if _guarded:
    signal.signal(signal.SIGINT, _end_while_starting)
try:
    from jaxdist.cli.main import main
finally:
    if _guarded:
        signal.signal(signal.SIGINT, signal.default_int_handler)

__all__ = ["main"]
