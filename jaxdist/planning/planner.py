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
  exchanges sit on the critical path and are exposed, but the tensor axis's where the
  hardware says its framework pipelines them with their GEMMs (`tensor_overlap`);
- T_sync: stragglers. With per-device step-time jitter sigma, the slowest of N devices is
  about sigma * sqrt(2 ln N) behind the mean, and every synchronous step waits for it.
- Replica groups (a `replica` axis, DiLoCo): one group's step by the law above, at its block
  of the batch over the other axes, plus the outer exchange over the slow link amortized over
  its H steps, less what `--sync-delay` hides (planning.sync); asked for by `replica` in the
  axes. Each of the top layouts is also given the slow link's bandwidth at which its compute
  fills 80% of the step (`link_gbps_80`). Groups reach data parallelism's loss in more or
  fewer tokens (planning.quality, from Charles et al.'s tables): layouts are ranked by the
  step time times that factor (`to_loss_s`; the factor is 1 without groups).
Every figure is a prediction; `--verify` compiles the top layouts and sets XLA beside them.
"""

import dataclasses
import math
from collections.abc import Sequence

from jaxdist.errors import ConfigError
from jaxdist.hardware import Hardware, get_hardware, with_slow_link
from jaxdist.layout import MESH_AXES, REPLICA, AxisRules, Layout, ways
from jaxdist.parallel import schedules
from jaxdist.planning import compute, costmodel, fit, fp8, layouts, memory, quality, sync, traffic
from jaxdist.planning.inputs import PlanConfig, PlanModel

OVERLAPPABLE = {"all-gather", "reduce-scatter", "collective-permute"}


def _axis_time(kind: str, nbytes: float, label: str, sizes: dict[str, int], hw) -> float:
    """Seconds of one collective over the groups of an axis label (data+fsdp): devices of inner
    mesh axes sit between a group's members, so the stride is their product."""
    names = label.split("+")
    group = ways(sizes, names)
    innermost = max(MESH_AXES.index(a) for a in names)
    stride = ways(sizes, MESH_AXES[innermost + 1 :])
    return costmodel.spanning_time(kind, nbytes, group, stride, hw)


def _comm_seconds(
    expected: dict, issued: dict, layout: Layout, model: PlanModel, hw
) -> tuple[float, float, dict]:
    """(exposed seconds, seconds that may hide behind compute, each axis and kind's bytes and
    seconds) of the expected traffic, on the links its groups span."""
    exposed = hidden_candidates = 0.0
    by_axis = {}
    # One collective per layer and microbatch, each paying the latency term, but where the
    # traffic says how many a key issues (the lookup's, once per microbatch).
    per_layer = max(1, model.num_layers * layout.microbatches // layout.stages)
    for (label, kind), nbytes in expected.items():
        messages = issued.get((label, kind), per_layer)
        t = _axis_time(kind, nbytes / messages, label, layout.mesh_shape, hw) * messages
        by_axis[f"{label} {kind}"] = {"bytes": nbytes, "seconds": t}
        gradient = kind == "all-reduce" and not _is_activation(label, layout)
        if kind in OVERLAPPABLE or gradient or (hw.tensor_overlap and label == "tensor"):
            hidden_candidates += t
        else:
            exposed += t
    return exposed, hidden_candidates, by_axis


def _is_activation(label: str, layout: Layout) -> bool:
    """An all-reduce over a tensor or expert axis sums activations (on the critical path);
    over batch axes it sums gradients (can hide behind the backward pass)."""
    return not set(label.split("+")) <= set(layout.batch_axes)


def hardware_of(cfg: PlanConfig) -> Hardware:
    """The hardware planned for: the preset, its slow link at `link_gbps` where given."""
    hw = get_hardware(cfg.hardware)
    return hw if cfg.link_gbps is None else with_slow_link(hw, cfg.link_gbps)


def evaluate(
    layout: Layout,
    model: PlanModel,
    hw: Hardware,
    efficiency: float | None = None,
    mem: dict | None = None,
):
    """Predicted memory and step time of one layout, `model` at the layout's remat policy
    (`mem`: its memory, where the caller priced it already); with --fp8, beside the same
    layout's in the compute dtype (`fp8`: planning.fp8.comparison)."""
    mem = mem or memory.device_peak(model, layout, hw.platform)
    row = _evaluate(layout, model, hw, efficiency, mem)
    row = quality.with_quality(row, model.abstract_params, layout)
    if layout.step.fp8 != "off":
        bf16 = _evaluate(fp8.without(layout), model, hw, efficiency, mem)
        row["fp8"] = fp8.comparison(fp8.admit(compute.work_of(model), layout, hw), row, bf16)
    return row


def _evaluate(layout: Layout, model: PlanModel, hw: Hardware, efficiency, mem: dict) -> dict:
    if layout.grouped:  # one group's step, then the outer exchange beside it
        inner = _evaluate(layout.group_alone(), model, hw, efficiency, mem)
        return sync.with_outer(inner, model.abstract_params, layout, hw)
    issued: dict = {}
    expected = traffic.layout_bytes(model, layout, hw.platform, issued)
    tokens = layout.batch_size * layout.seq_len
    tensor = layout.mesh_shape.get("tensor", 1)
    priced = compute.seconds(
        fp8.admit(compute.work_of(model), layout, hw),
        tokens * tensor / layout.devices,  # each device's tokens through every layer
        hw,
        tensor,
        model.compute_bytes,
        mem["params"],
        efficiency,
        weight_passes=layout.microbatches / layout.stages,
    )
    compute_s = priced["total"]
    # The schedule's own idle share b of stage-ticks stretches the step by b / (1 - b):
    # (p-1)/m for GPipe and 1F1B, (p-1)/(vm) interleaved.
    idle = schedules.for_layout(layout).bubble() if layout.stages > 1 else 0.0
    bubble = compute_s * idle / (1 - idle)
    exposed, hidden_candidates, by_axis = _comm_seconds(expected, issued, layout, model, hw)
    t_comm = exposed + hidden_candidates
    t_overlap = min(compute_s, hw.overlap * hidden_candidates)
    n = layout.devices
    straggler = hw.jitter * compute_s * math.sqrt(2 * math.log(n)) if n > 1 else 0
    step = compute_s + bubble + t_comm + straggler - t_overlap
    flops = model.flops_per_token * tokens
    return {
        "layout": layout.describe(),
        "hardware": hw.name,
        "remat": model.remat,
        "mesh": layout.mesh_shape,
        "microbatches": layout.microbatches,
        "seq_len": layout.seq_len,
        "memory_bytes": mem,
        "fits": fit.fits(mem["peak"], hw.memory_bytes, hw.platform),
        "compute_s": compute_s,
        "compute_by_kind": priced,
        "bubble_s": bubble,
        "comm_s": t_comm,
        "comm_exposed_s": exposed,
        "overlap_s": t_overlap,
        "sync_s": straggler,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "mfu": flops / (step * n * hw.peak_flops),
        "comm_bytes": sum(expected.values()),
        "by_axis": by_axis,
        "expected": {f"{label}|{kind}": b for (label, kind), b in expected.items()},
    }


def price(
    sizes: dict[str, int],
    models: Sequence[PlanModel],
    rules: AxisRules,
    cfg: PlanConfig,
    hw: Hardware | None = None,
) -> dict:
    """One split priced at the fastest remat policy of `models` (fastest first) that fits it
    (jaxdist.planning.fit.choose: the one chooser), or at the leanest, marked not fitting."""
    hw = hw or hardware_of(cfg)
    by_policy = {m.remat: m for m in models}
    seq_len = models[0].seq_len

    def layout(policy: str) -> Layout:
        return layouts.layout_of(sizes, rules, cfg, seq_len, policy)

    priced = {}

    def peak_of(policy: str) -> float:
        priced[policy] = memory.device_peak(by_policy[policy], layout(policy), hw.platform)
        return priced[policy]["peak"]

    choice = fit.choose(list(by_policy), peak_of, hw.memory_bytes, hw.platform)
    best = by_policy[choice.policy]
    return evaluate(layout(choice.policy), best, hw, cfg.compute_efficiency, priced[choice.policy])


def plan(models: PlanModel | Sequence[PlanModel], rules: AxisRules, cfg: PlanConfig) -> dict:
    """Every feasible layout, fastest first, or a ConfigError naming the nearest way out.
    Several `models` (one per remat policy, fastest first): each layout takes the fastest that
    fits."""
    models = [models] if isinstance(models, PlanModel) else list(models)
    model = models[0]
    hw = hardware_of(cfg)
    unknown = set(cfg.axes) - set(MESH_AXES)
    if unknown or not cfg.axes:
        raise ConfigError(f"--axes {','.join(cfg.axes)}: choose from {', '.join(MESH_AXES)}")
    if cfg.devices < 1 or cfg.batch_size < 1:
        raise ConfigError("--devices and --batch-size must be positive")
    if cfg.mesh:
        return _one_layout(models, rules, cfg, hw)
    candidates, rejected = _candidates(model, rules, cfg, hw)
    if not candidates:
        raise ConfigError(_no_layout_message(model, rules, cfg, rejected))
    rows = [price(s, models, rules, cfg, hw) for s in candidates]
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        best = min(rows, key=lambda r: r["memory_bytes"]["peak"])
        need = best["memory_bytes"]["peak"]
        usable = fit.usable(hw.memory_bytes, hw.platform)
        more = math.ceil(cfg.devices * need / usable)
        raise ConfigError(
            f"{model.name} fits no layout of {cfg.devices} {hw.name} devices: the leanest, "
            f"{best['layout']}, needs {fit.gib(need, 1)} per device of "
            f"{fit.gib(usable, 1)} usable; try --remat full, a "
            f"smaller --batch-size, or about {more} devices"
        )
    fitting.sort(key=lambda r: r["to_loss_s"])  # the step, times replica groups' tokens
    naive = next((r for r in rows if r["layout"] == f"data={cfg.devices}"), None)
    _link_needs(fitting[:LINK_ROWS] + ([naive] if naive else []), models, rules, cfg, hw)
    return {
        **_heading(model, cfg, hw),
        "considered": len(candidates) + sum(rejected.values()),
        "rejected": rejected,
        "too_big": len(rows) - len(fitting),
        "naive": naive,
        "layouts": fitting[: cfg.max_layouts],
        "best_grouped": _best_grouped(fitting, rows) if REPLICA in cfg.axes else None,
    }


def _best_grouped(fitting: list[dict], rows: list[dict]) -> dict:
    """Where replica groups were asked for: the fastest layout of groups to data parallelism's
    loss, its rank among those that fit, and the first choice it is beside (the printer says
    why it ranks there), or why none is in the ranking."""
    grouped = [r for r in rows if r["mesh"].get(REPLICA, 1) > 1]
    for rank, row in enumerate(fitting, 1):
        if row["mesh"].get(REPLICA, 1) > 1:
            return {"rank": rank, "of": len(fitting), "row": row, "first": fitting[0]}
    return {"rank": None, "of": len(fitting), "priced": len(grouped)}


# The top layouts whose slow-link need for 80% compute utilization the plan solves for.
LINK_ROWS = 3


def _link_needs(rows: list[dict], models, rules, cfg: PlanConfig, hw: Hardware) -> None:
    """Each row's `link_gbps_80`: Gbit/s per device of the slow link at which its compute
    fills sync.TARGET_UTILIZATION of compute and exposed communication (0.0: nothing crosses
    it; None: its fast links alone miss it), at the remat policy it was priced at."""
    by_policy = {m.remat: m for m in models}
    for row in rows:
        sizes = {a: n for a, n in row["mesh"].items() if n > 1}
        layout = layouts.layout_of(sizes, rules, cfg, row["seq_len"], row["remat"])
        model, mem = by_policy[row["remat"]], row["memory_bytes"]

        def priced(hw_at: Hardware, layout=layout, model=model, mem=mem) -> dict:
            return evaluate(layout, model, hw_at, cfg.compute_efficiency, mem)

        row["link_gbps_80"] = sync.bandwidth_for(priced, hw, sync.TARGET_UTILIZATION)


def _heading(model: PlanModel, cfg: PlanConfig, hw) -> dict:
    return dict(model=model.name, devices=cfg.devices, hardware=hw.name, slice=hw.slice_name) | {
        "machine": hw.machine,
        "between_hosts_bytes_s": hw.outer.bandwidth,
        "slow_link": hw.slow_link,
        "devices_per_host": hw.devices_per_host,
        "batch_size": cfg.batch_size,
        "seq_len": model.seq_len,
        "memory_per_device": hw.memory_bytes,
        "usable_per_device": fit.usable(hw.memory_bytes, hw.platform),
        "fit_rule": fit.verdict(0.0, hw.memory_bytes, hw.platform).rule(),
    }


def _one_layout(models: list[PlanModel], rules: AxisRules, cfg: PlanConfig, hw) -> dict:
    """The plan of one given layout (`--mesh`), priced whether or not it fits in memory."""
    model = models[0]
    sizes = {a: n for a, n in cfg.mesh if n != 1}
    order = sorted(sizes, key=lambda a: MESH_AXES.index(a) if a in MESH_AXES else len(MESH_AXES))
    name = ",".join(f"{a}={sizes[a]}" for a in order) or "single"
    if set(sizes) - set(MESH_AXES):
        raise ConfigError(f"--mesh {name}: axes are {', '.join(MESH_AXES)}")
    if math.prod(sizes.values()) != cfg.devices:
        raise ConfigError(
            f"--mesh {name} spans {math.prod(sizes.values())} devices, not --devices "
            f"{cfg.devices}: make them agree"
        )
    reason = layouts.why_not(layouts.layout_of(sizes, rules, cfg, model.seq_len), model, hw)
    if reason:
        raise ConfigError(f"--mesh {name} cannot run {model.name}: {reason.message}")
    row = price(sizes, models, rules, cfg, hw)
    _link_needs([row], models, rules, cfg, hw)
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
    axes = tuple(a for a in MESH_AXES if a in cfg.axes)
    for sizes in layouts.factorizations(cfg.devices, axes, cfg.replicas):
        reason = layouts.why_not(layouts.layout_of(sizes, rules, cfg, model.seq_len), model, hw)
        if reason is None:
            candidates.append(sizes)
        else:
            # One count per kind of reason (thousands of layouts at scale).
            rejected[reason.kind] = rejected.get(reason.kind, 0) + 1
    return candidates, rejected


def _no_layout_message(model, rules, cfg, rejected) -> str:
    hw = hardware_of(cfg)
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
