"""A step too big for this host's memory, refused before it compiles.

Fake CPU devices (`--devices cpu:N`) all live in the host's memory, so a step whose buffers
outgrow it is killed by the kernel minutes into compiling or running, saying nothing but XLA's
own lines. The one price of a step's memory (jaxdist.planning.memory.device_peak) gives a
device's share from shapes alone, in milliseconds; this process's devices together need that
many times over.
"""

import dataclasses
import os

from jaxdist.errors import ConfigError
from jaxdist.layout import Layout
from jaxdist.planning.fit import fits, usable
from jaxdist.planning.inputs import PlanModel
from jaxdist.planning.memory import device_peak


def available_bytes() -> int | None:
    """Memory the host can give without swapping (Linux's MemAvailable, else the free pages);
    None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check(
    model: PlanModel, layout: Layout, local_devices: int, available: int | None = None
) -> float:
    """The bytes this process's `local_devices` need together (each device's peak by the one
    price, jaxdist.planning.memory.device_peak); a ConfigError naming the need, what is
    `available` (default: what the host has now) and the fixes, where it exceeds it."""
    gb = 1e9
    need = local_devices * device_peak(model, layout, "cpu")["peak"]
    if available is None:
        available = available_bytes()
    if available is None or fits(need, available, "cpu"):
        return need
    fixes = ["a smaller --batch-size"]
    smaller = _smaller_batch(model, layout, local_devices, available)
    if smaller:
        b, b_need = smaller
        ok = fits(b_need, available, "cpu")
        fixes[0] += f" ({'' if ok else 'even '}{b} needs {b_need / gb:.1f} GB)"
    if model.remat != "full":
        fixes.append("--remat full")
    raise ConfigError(
        f"this step needs about {need / gb:.1f} GB of host memory ({local_devices} devices x "
        f"{need / local_devices / gb:.2f} GB, the planner's memory model) but "
        f"{available / gb:.1f} GB is available ({usable(available, 'cpu') / gb:.1f} GB of it for "
        "the step: jaxdist.planning.fit); fake CPU "
        "devices share the host's memory: use "
        f"{', '.join(fixes)}, or a smaller --model"
    )


def _smaller_batch(model: PlanModel, layout: Layout, local_devices: int, available: int):
    """The largest halving of the batch that fits, or else the smallest that still splits
    over the batch axes and microbatches, with its need; None if no halving splits."""
    unit = layout.batch_unit
    found = None
    b = layout.batch_size // 2
    while b >= unit and b % unit == 0:
        smaller = dataclasses.replace(layout, batch_size=b)
        found = b, local_devices * device_peak(model, smaller, "cpu")["peak"]
        if fits(found[1], available, "cpu"):
            break
        b //= 2
    return found
