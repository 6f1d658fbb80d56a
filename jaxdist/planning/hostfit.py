"""A step too big for this host's memory, refused before it compiles.

Fake CPU devices (`--devices cpu:N`) all live in the host's memory, so a step whose buffers
outgrow it is killed by the kernel minutes into compiling or running, saying nothing but XLA's
own lines. The planner's memory model (jaxdist.planning.memory.predict) prices one device's
share from shapes alone, in milliseconds; this process's devices together need that many
times over.
"""

import os

from jaxdist.errors import ConfigError
from jaxdist.parallel import pipeline
from jaxdist.planning import memory
from jaxdist.planning.planner import PlanModel
from jaxdist.rules import AxisRules, ways
from jaxdist.step import StepConfig

# The compiler, the runtime, the data and Python itself need some of what is available too.
HEADROOM = 0.9


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


def device_bytes(
    model: PlanModel,
    rules: AxisRules,
    mesh_shape: dict[str, int],
    batch_size: int,
    step: StepConfig,
) -> float:
    """One device's predicted peak, with the step's microbatches, fused loss and pipeline
    buffers, as the planner prices a layout (jaxdist.planning.planner.evaluate)."""
    stages = mesh_shape.get("pipeline", 1)
    m = step.microbatches
    stash = _stash(model, rules, mesh_shape, batch_size, step) if stages > 1 else 0.0
    inventory = model.inventory(max(1, batch_size // m))
    if step.loss_chunk_tokens:
        inventory = memory.with_fused_loss(inventory, step.loss_chunk_tokens, model.compute_bytes)
    return memory.predict(
        model.abstract_params,
        rules,
        mesh_shape,
        inventory,
        model.num_layers // stages,
        batch_size,
        model.seq_len,
        model.compute_bytes,
        stash,
        microbatches=max(1, m),
    )["peak"]


def _stash(model, rules, mesh_shape, batch_size, step) -> float:
    """A pipeline stage's forward inbox, backward inbox and stash of microbatch inputs, as
    the planner counts them; 0 for a schedule the step refuses (in its own words, later)."""
    m = step.microbatches
    v = step.virtual_stages if step.pipeline_schedule == "interleaved" else 1
    try:
        schedule = pipeline.make_schedule(step.pipeline_schedule, mesh_shape["pipeline"], m, v)
    except ConfigError:
        return 0.0
    batch_ways = ways(mesh_shape, rules.mesh_axes("batch", "activation"))
    micro = pipeline.microbatch_bytes(
        batch_size, m, batch_ways, model.seq_len, model.d_model, model.compute_bytes
    )
    return 3 * v * schedule.capacity * micro


def check(
    model: PlanModel,
    rules: AxisRules,
    mesh_shape: dict[str, int],
    batch_size: int,
    step: StepConfig,
    local_devices: int,
    available: int | None = None,
    remat: str | None = None,
) -> float:
    """The bytes this process's `local_devices` need together; a ConfigError naming the need,
    what is `available` (default: what the host has now) and the fixes, where it exceeds it.
    `remat`: the model's policy (the fix "--remat full" is not offered where it is full)."""
    gb = 1e9
    need = local_devices * device_bytes(model, rules, mesh_shape, batch_size, step)
    if available is None:
        available = available_bytes()
    if available is None or need <= HEADROOM * available:
        return need
    fixes = ["a smaller --batch-size"]
    smaller = _smaller_batch(model, rules, mesh_shape, batch_size, step, local_devices, available)
    if smaller:
        b, b_need = smaller
        fits = b_need <= HEADROOM * available
        fixes[0] += f" ({'' if fits else 'even '}{b} needs {b_need / gb:.1f} GB)"
    if remat != "full":
        fixes.append("--remat full")
    raise ConfigError(
        f"this step needs about {need / gb:.1f} GB of host memory ({local_devices} devices x "
        f"{need / local_devices / gb:.2f} GB, the planner's memory model) but "
        f"{available / gb:.1f} GB is available ({HEADROOM:.0%} of it for the step); fake CPU "
        "devices share the host's memory: use "
        f"{', '.join(fixes)}, or a smaller --model"
    )


def _smaller_batch(model, rules, mesh_shape, batch_size, step, local_devices, available):
    """The largest halving of `batch_size` that fits, or else the smallest that still splits
    over the batch axes and microbatches, with its need; None if no halving splits."""
    unit = ways(mesh_shape, rules.mesh_axes("batch", "activation")) * step.microbatches
    found = None
    b = batch_size // 2
    while b >= unit and b % unit == 0:
        found = b, local_devices * device_bytes(model, rules, mesh_shape, b, step)
        if found[1] <= HEADROOM * available:
            break
        b //= 2
    return found
