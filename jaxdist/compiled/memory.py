"""A compiled step's memory and the device's it must fit: XLA's own peak of the program
(`xla_peak`), the bytes of the device it runs on or is compiled for (`device_memory`), and
what XLA's rematerialization pass says while compiling (`xla_said`, `remat_said`)."""

import contextlib
import os
import re
import sys
import tempfile

from jaxdist import hardware
from jaxdist.planning.hostfit import available_bytes


def xla_peak(stats) -> int:
    """XLA's own per-device figure from a compiled step's memory analysis: arguments, outputs
    and temporaries, with donated state (aliased to its output) counted once: the buffers the
    finished program allocates (its `total_allocation_bytes`). Its `peak_memory_in_bytes`, the
    heap simulator's most bytes live at once inside them, may be less (84.56 against 88.44 GiB
    for tiny-llama at batch 65,536 on h100:8)."""
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def target_hardware(target: str) -> str:
    """The hardware preset of a --target (tpu-v5p:2x2x2 -> tpu-v5p, h100:8 -> h100, v5p-16 ->
    v5p-16, whose chips are tpu-v5p's)."""
    return target.split(":")[0]


def device_memory(mesh, target: str | None) -> float | None:
    """Bytes of one device: a target's chip, an accelerator's own limit, or (fake CPU devices)
    this process's share of the host's available memory; None if unknown."""
    if target:
        return hardware.get_hardware(target_hardware(target)).memory_bytes
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        available = available_bytes()
        return available / len(mesh.local_devices) if available else None
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return stats["bytes_limit"]
    known = hardware.lookup(device)
    return known.memory_bytes if known else None


# XLA's rematerialization pass (hlo_rematerialization.cc), where it cannot bring the program
# under its limit: "Can't reduce memory use below 60.06GiB (64492914014 bytes) by
# rematerialization; only reduced to 96.38GiB (103484115181 bytes), down from 100.51GiB
# (107926374703 bytes) originally".
_REMAT = re.compile(
    r"Can't reduce memory use below \S+ \((\d+) bytes\) by rematerialization; only reduced "
    r"to \S+ \((\d+) bytes\), down from \S+ \((\d+) bytes\)"
)


def remat_said(lines: list[str]) -> dict | None:
    """XLA's rematerialization figures from its log lines (the last compile's): the limit it
    aimed at, what it reached and where it began, in bytes; None where it said nothing.

    They are the pass's own count of the program at that point of the pipeline (every value
    live in its schedule, before fusion and buffer assignment), against a limit of its own (on
    GPU, less than the device: 60.06 GiB for an H100's 79.1), not the finished program's
    buffers: tiny-llama at batch 65,536 on h100:8 was "only reduced to 96.38GiB" and compiled
    to 88.44 GiB of buffers; the README's issue saw 70.21 beside 64.63."""
    found = [m for m in map(_REMAT.search, lines) if m]
    if not found:
        return None
    limit, reached, before = (int(x) for x in found[-1].groups())
    return {"limit_bytes": limit, "reached_bytes": reached, "before_bytes": before}


@contextlib.contextmanager
def xla_said():
    """Copies what XLA's C++ logs on stderr (file descriptor 2) during the block into the list
    it yields, and passes it on to stderr after: its rematerialization line set beside the
    report's table. Also yields where to write what must show meanwhile (the compile's line,
    a spinner): the real stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    said: list[str] = []
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(tempfile.TemporaryFile())
        live = sys.stderr  # a stand-in for stderr (a test's capture) stays as it is
        if _is_fd2(sys.stderr):
            live = stack.enter_context(os.fdopen(os.dup(saved), "w"))
        os.dup2(log.fileno(), 2)
        try:
            yield said, live
        finally:
            live.flush()
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            text = log.read().decode(errors="replace")
            sys.stderr.write(text)
            sys.stderr.flush()
            said.extend(text.splitlines())


def _is_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False
