"""The planner: choose a layout before renting the fleet (stage 1 of a step: distribute work).

For N devices it enumerates every way to split them over the mesh axes, keeps the layouts the
model divides evenly and whose predicted per-device memory fits, predicts each one's step time
with the fleet law and ranks them:

    T_step = T_compute/N (+ pipeline bubble) + T_comm + T_sync - T_overlap

- T_compute: the model's training FLOPs and element-wise bytes, recompute included, at the
  rates the hardware preset was calibrated to (planning.compute; experiments/calibration.py
  sets them beside published runs), or all FLOPs at one `compute_efficiency` if given;
- T_comm: the bytes planning.traffic expects for the layout (the figure `jaxdist comm` checks
  against the compiled HLO), priced by the alpha-beta model of planning.costmodel on the link
  each axis's groups span (inner while a group fits in a host or TPU slice; a group spanning
  several runs in two levels, inside each, then across over InfiniBand or DCN);
- T_overlap: FSDP gathers, gradient reductions and pipeline sends can run behind compute (the
  hardware preset's `overlap` share of them, at most T_compute); tensor- and expert-parallel
  exchanges sit on the critical path and are always exposed;
- T_sync: stragglers. With per-device step-time jitter sigma, the slowest of N devices is
  about sigma * sqrt(2 ln N) behind the mean, and every synchronous step waits for it.
Every figure is a prediction; `--verify` compiles the top layouts and sets XLA beside them.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence

from flax import nnx

from jaxdist.errors import ConfigError
from jaxdist.hardware import get_hardware
from jaxdist.mesh import MESH_AXES
from jaxdist.parallel import pipeline
from jaxdist.parallel.context import carrier
from jaxdist.planning import compute, costmodel, layouts, memory, traffic
from jaxdist.rules import AxisRules, ways
from jaxdist.step import StepConfig

MEMORY_HEADROOM = 0.9  # XLA's allocator and the runtime keep some of the device's memory


@dataclasses.dataclass(frozen=True)
class PlanModel:
    """What the planner needs of a model, declared in logical axes only."""

    name: str
    abstract_params: nnx.State
    num_layers: int
    seq_len: int
    d_model: int
    flops_per_token: float
    compute_bytes: int
    num_experts: int
    inventory: Callable[[int], memory.Inventory]  # rows of one microbatch -> activations
    partial_sums: Callable[[int, int, int], list]  # (batch, microbatches, batch_ways)
    # What its remat policy reruns in the backward pass (planning.compute.Work): a share of
    # each layer's forward weight matmuls, and attention's forward or not.
    recompute_matmul: float = 0.0
    recompute_attention: bool = False
    remat: str = ""  # the policy's name, for the plan's rows
    # The logical axes of the layer weights whose forward matmul the policy reruns in the
    # backward (the TPU compiler then gathers them once there: planning.traffic).
    reruns: frozenset[tuple] = frozenset()


# The axes searched unless --axes names others: all of them. A context split pays K/V traffic
# every layer, priced here, so it ranks first only where it pays: rows too few to split over
# the devices, or too long for their activations to fit (Llama-2-7B, 2 rows of 32K on 8 v5p
# chips: fsdp=2,context=4 at 2.25 s a step, against 2.89 s for the best layout without it).
DEFAULT_AXES: tuple[str, ...] = MESH_AXES


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    devices: int
    hardware: str
    batch_size: int
    axes: tuple[str, ...] = DEFAULT_AXES
    microbatches: int = 0  # 0: 1 without a pipeline, 4 per stage with one
    schedule: str = "1f1b"
    virtual_stages: int = 1  # interleaved: layer chunks per device
    compute_efficiency: float | None = None  # None: the hardware's calibrated rates
    max_layouts: int = 10
    layout: tuple[tuple[str, int], ...] = ()  # price this one layout instead of enumerating
    # The step's fused cross-entropy (jaxdist.step): tokens per device per chunk; 0: unfused.
    loss_chunk_tokens: int = StepConfig().loss_chunk_tokens
    context_strategy: str = StepConfig().context_strategy  # how attention crosses `context`
    collective_matmul: str = StepConfig().collective_matmul  # the TPU's streamed weight rings


def _axis_time(kind: str, nbytes: float, label: str, sizes: dict[str, int], hw) -> float:
    """Seconds of one collective over the groups of an axis label (data+fsdp): devices of inner
    mesh axes sit between a group's members, so the stride is their product."""
    names = label.split("+")
    group = ways(sizes, names)
    innermost = max(MESH_AXES.index(a) for a in names)
    stride = ways(sizes, MESH_AXES[innermost + 1 :])
    return costmodel.spanning_time(kind, nbytes, group, stride, hw)


OVERLAPPABLE = {"all-gather", "reduce-scatter", "collective-permute"}


def _memory(
    sizes: dict[str, int],
    model: PlanModel,
    rules: AxisRules,
    cfg: PlanConfig,
    stash: float,
    platform: str,
) -> dict[str, float]:
    """Predicted bytes per device by term (jaxdist.planning.memory); `stash`: a pipeline
    stage's buffers of microbatch inputs."""
    stages = sizes.get("pipeline", 1)
    m = layouts.microbatches(cfg, stages)
    inventory = model.inventory(cfg.batch_size // m)
    if cfg.loss_chunk_tokens:  # the fused loss, a pipeline's last stage's too
        inventory = memory.with_fused_loss(inventory, cfg.loss_chunk_tokens, model.compute_bytes)
    return memory.predict(
        model.abstract_params,
        rules,
        dict(layouts.abstract_mesh(sizes).shape),
        inventory,
        model.num_layers // stages,
        cfg.batch_size,
        model.seq_len,
        model.compute_bytes,
        stash,
        platform,
        m,
    )


def _comm_seconds(
    expected: dict, sizes: dict[str, int], model: PlanModel, rules: AxisRules, m: int, hw
) -> tuple[float, float, dict]:
    """(exposed seconds, seconds that may hide behind compute, each axis and kind's bytes and
    seconds) of the expected traffic, on the links its groups span."""
    stages = sizes.get("pipeline", 1)
    exposed = hidden_candidates = 0.0
    by_axis = {}
    # One collective per layer and microbatch: each pays the latency term.
    messages = max(1, model.num_layers * m // max(1, stages))
    for (label, kind), nbytes in expected.items():
        t = _axis_time(kind, nbytes / messages, label, sizes, hw) * messages
        by_axis[f"{label} {kind}"] = {"bytes": nbytes, "seconds": t}
        if kind in OVERLAPPABLE or (kind == "all-reduce" and not _is_activation(label, rules)):
            hidden_candidates += t
        else:
            exposed += t
    return exposed, hidden_candidates, by_axis


def _traffic(
    sizes: dict[str, int], model: PlanModel, rules: AxisRules, cfg: PlanConfig, platform: str
) -> dict[tuple[str, str], float]:
    """Collective bytes per step by (axis label, kind), as `platform`'s compiler emits them
    (jaxdist.planning.traffic), for one layout."""
    stages = sizes.get("pipeline", 1)
    m = layouts.microbatches(cfg, stages)
    v = cfg.virtual_stages if cfg.schedule == "interleaved" else 1
    return traffic.expected(
        model.abstract_params,
        layouts.abstract_mesh(sizes),
        rules,
        model.partial_sums(
            *(cfg.batch_size, m, ways(sizes, rules.mesh_axes("batch", "activation")), stages, v),
            (
                carrier(cfg.context_strategy, platform, stages > 1),
                ways(sizes, rules.mesh_axes("seq", "activation")),
            ),
            platform=platform,
        ),
        model.compute_bytes,
        m,
        platform=platform,
        tokens_BT=(cfg.batch_size // m, model.seq_len),
        reruns=model.reruns,
        collective_matmul=cfg.collective_matmul,
        fused_loss=cfg.loss_chunk_tokens > 0,
    )


def evaluate(sizes: dict[str, int], model: PlanModel, rules: AxisRules, cfg: PlanConfig) -> dict:
    """Predicted memory and step time of one layout."""
    hw = get_hardware(cfg.hardware)
    stages = sizes.get("pipeline", 1)
    m = layouts.microbatches(cfg, stages)
    batch_ways = ways(sizes, rules.mesh_axes("batch", "activation"))
    context_ways = ways(sizes, rules.mesh_axes("seq", "activation"))
    mesh = layouts.abstract_mesh(sizes)
    v = cfg.virtual_stages if cfg.schedule == "interleaved" else 1
    schedule = pipeline.make_schedule(cfg.schedule, stages, m, v) if stages > 1 else None
    micro_act = pipeline.microbatch_bytes(
        # a device's share of the sequence, where context splits it
        *(cfg.batch_size, m, batch_ways, model.seq_len // context_ways),
        *(model.d_model, model.compute_bytes),
    )
    # Three buffers (forward inbox, backward inbox, stash), each of `capacity` microbatch inputs
    # per virtual stage: all m for GPipe, at most p for 1F1B.
    stash = 3 * v * schedule.capacity * micro_act if schedule else 0.0
    mem = _memory(sizes, model, rules, cfg, stash, hw.platform)
    expected = _traffic(sizes, model, rules, cfg, hw.platform)
    if schedule:
        expected[("pipeline", "collective-permute")] = pipeline.send_bytes(
            schedule, model.abstract_params, rules, dict(mesh.shape), micro_act, model.compute_bytes
        )
    tokens = cfg.batch_size * model.seq_len
    tensor = sizes.get("tensor", 1)
    priced = compute.seconds(
        compute.work_of(model),
        tokens * tensor / cfg.devices,  # each device's tokens through every layer
        hw,
        tensor,
        model.compute_bytes,
        mem["params"],
        cfg.compute_efficiency,
    )
    compute_s = priced["total"]
    # The schedule's own idle share b of stage-ticks stretches the step by b / (1 - b):
    # (p-1)/m for GPipe and 1F1B, (p-1)/(vm) interleaved.
    idle = schedule.bubble() if schedule else 0.0
    bubble = compute_s * idle / (1 - idle)
    exposed, hidden_candidates, by_axis = _comm_seconds(expected, sizes, model, rules, m, hw)
    t_comm = exposed + hidden_candidates
    t_overlap = min(compute_s, hw.overlap * hidden_candidates)
    sync = hw.jitter * compute_s * math.sqrt(2 * math.log(cfg.devices)) if cfg.devices > 1 else 0
    step = compute_s + bubble + t_comm + sync - t_overlap
    flops = model.flops_per_token * tokens
    return {
        "layout": layouts.describe(sizes),
        "remat": model.remat,
        "mesh": {a: sizes.get(a, 1) for a in MESH_AXES},
        "microbatches": m,
        "memory_bytes": mem,
        "fits": mem["peak"] <= MEMORY_HEADROOM * hw.memory_bytes,
        "compute_s": compute_s,
        "compute_by_kind": priced,
        "bubble_s": bubble,
        "comm_s": t_comm,
        "comm_exposed_s": exposed,
        "overlap_s": t_overlap,
        "sync_s": sync,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "mfu": flops / (step * cfg.devices * hw.peak_flops),
        "comm_bytes": sum(expected.values()),
        "by_axis": by_axis,
        "expected": {f"{label}|{kind}": b for (label, kind), b in expected.items()},
    }


def _is_activation(label: str, rules: AxisRules) -> bool:
    """An all-reduce over a tensor or expert axis sums activations (on the critical path);
    over batch axes it sums gradients (can hide behind the backward pass)."""
    batch = set(rules.mesh_axes("batch", "activation"))
    return not set(label.split("+")) <= batch


def fastest_fitting(
    sizes: dict[str, int], models: Sequence[PlanModel], rules: AxisRules, cfg: PlanConfig
) -> dict:
    """The layout priced with the first of `models` (fastest remat first) that fits it."""
    for model in models:
        row = evaluate(sizes, model, rules, cfg)
        if row["fits"]:
            break
    return row


def plan(models: PlanModel | Sequence[PlanModel], rules: AxisRules, cfg: PlanConfig) -> dict:
    """Every feasible layout, fastest first, or a ConfigError naming the nearest way out.
    Several `models` (one per remat policy, fastest first): each layout takes the fastest."""
    models = [models] if isinstance(models, PlanModel) else list(models)
    model = models[0]
    hw = get_hardware(cfg.hardware)
    unknown = set(cfg.axes) - set(MESH_AXES)
    if unknown or not cfg.axes:
        raise ConfigError(f"--axes {','.join(cfg.axes)}: choose from {', '.join(MESH_AXES)}")
    if cfg.devices < 1 or cfg.batch_size < 1:
        raise ConfigError("--devices and --batch-size must be positive")
    if cfg.layout:
        return _one_layout(models, rules, cfg, hw)
    candidates, rejected = _candidates(model, rules, cfg, hw)
    if not candidates:
        raise ConfigError(_no_layout_message(model, rules, cfg, rejected))
    rows = [fastest_fitting(s, models, rules, cfg) for s in candidates]
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        best = min(rows, key=lambda r: r["memory_bytes"]["peak"])
        need = best["memory_bytes"]["peak"]
        more = math.ceil(cfg.devices * need / (MEMORY_HEADROOM * hw.memory_bytes))
        raise ConfigError(
            f"{model.name} fits no layout of {cfg.devices} {hw.name} devices: the leanest, "
            f"{best['layout']}, needs {need / 1e9:.1f} GB per device of "
            f"{MEMORY_HEADROOM * hw.memory_bytes / 1e9:.1f} GB usable; try --remat full, a "
            f"smaller --batch-size, or about {more} devices"
        )
    fitting.sort(key=lambda r: r["step_s"])
    naive = next((r for r in rows if r["layout"] == f"data={cfg.devices}"), None)
    return {
        **_heading(model, cfg, hw),
        "considered": len(candidates) + sum(rejected.values()),
        "rejected": rejected,
        "too_big": len(rows) - len(fitting),
        "naive": naive,
        "layouts": fitting[: cfg.max_layouts],
    }


def _heading(model: PlanModel, cfg: PlanConfig, hw) -> dict:
    return dict(model=model.name, devices=cfg.devices, hardware=hw.name, slice=hw.slice_name) | {
        "machine": hw.machine,
        "between_hosts_bytes_s": hw.outer.bandwidth,
        "devices_per_host": hw.devices_per_host,
        "batch_size": cfg.batch_size,
    }


def _one_layout(models: list[PlanModel], rules: AxisRules, cfg: PlanConfig, hw) -> dict:
    """The plan of one given layout (`--mesh`), priced whether or not it fits in memory."""
    model = models[0]
    sizes = {a: n for a, n in cfg.layout if n != 1}
    name = layouts.describe(sizes)
    if set(sizes) - set(MESH_AXES):
        raise ConfigError(f"--mesh {name}: axes are {', '.join(MESH_AXES)}")
    if math.prod(sizes.values()) != cfg.devices:
        raise ConfigError(
            f"--mesh {name} spans {math.prod(sizes.values())} devices, not --devices "
            f"{cfg.devices}: make them agree"
        )
    reason = layouts.why_not(sizes, model, rules, cfg, hw)
    if reason:
        raise ConfigError(f"--mesh {name} cannot run {model.name}: {reason}")
    row = fastest_fitting(sizes, models, rules, cfg)
    return {
        **_heading(model, cfg, hw),
        "considered": 1,
        "rejected": {},
        "too_big": 0,
        "naive": None,
        "layouts": [row],
    }


def _candidates(model, rules, cfg, hw) -> tuple[list[dict[str, int]], dict[str, int]]:
    candidates, rejected = [], {}
    for sizes in layouts.factorizations(cfg.devices, tuple(a for a in MESH_AXES if a in cfg.axes)):
        reason = layouts.why_not(sizes, model, rules, cfg, hw)
        if reason is None:
            candidates.append(sizes)
        else:
            # One count per kind of reason, whatever its numbers (thousands of layouts at scale).
            key = reason.split(" ")[0] if reason.startswith("batch") else reason
            if reason.startswith("layers or microbatches"):
                key = "layers or microbatches do not split over the stages"
            rejected[key] = rejected.get(key, 0) + 1
    return candidates, rejected


def _no_layout_message(model, rules, cfg, rejected) -> str:
    hw = get_hardware(cfg.hardware)
    reasons = "; ".join(f"{k} ({n})" for k, n in rejected.items())
    for delta in range(1, cfg.devices):
        for n in (cfg.devices - delta, cfg.devices + delta):
            if n >= 1 and _candidates(model, rules, dataclasses.replace(cfg, devices=n), hw)[0]:
                return (
                    f"{cfg.devices} devices cannot be split over --axes {','.join(cfg.axes)} "
                    f"for {model.name} at batch {cfg.batch_size} ({reasons}); nearest device "
                    f"count that works: {n}"
                )
    return f"no layout of {cfg.devices} devices works for {model.name}: {reasons}"
