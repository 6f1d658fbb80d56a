"""`jaxdist plan`: rank layouts for a model on N devices, and verify the best against XLA."""

import dataclasses
import json
import math
import time
from typing import Literal

from rich.console import Console
from rich.table import Table

MEMORY_TOLERANCE = 0.15  # predicted vs XLA's per-device memory
BYTES_TOLERANCE = 0.05  # predicted vs the compiled HLO's collective bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    """Rank the layouts of a model on N devices by predicted step time (memory must fit)."""

    model: str = "1b"
    devices: int = 64
    hardware: str = "h100-ib"
    """cost-model preset: cpu, h100-nvlink, h200-nvlink, h100-ib, tpu-v5p[-N], tpu-v5e[-N]"""
    batch_size: int = 512
    axes: str = "pipeline,data,fsdp,expert,tensor"
    """mesh axes the planner may use"""
    microbatches: int = 0
    """0: none without a pipeline, 4 per stage with one"""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """pipeline schedule priced for layouts with a pipeline axis"""
    virtual_stages: int = 2
    """layer chunks per device, for the interleaved schedule"""
    remat: str = "none"
    compute_efficiency: float = 0.5
    """share of peak FLOP/s the matmuls reach (0.4-0.6 on well-tuned GPUs and TPUs)"""
    top: int = 10
    verify: int = 0
    """compile the top K layouts ahead of time (fake CPU devices, or a TPU topology for TPU
    hardware) and set XLA's memory and collective bytes beside the predictions"""
    json: str | None = None
    """also write the plan as JSON to this file"""


def plan_model(model_cfg, init=None):
    """The planner's view of a model config (the wiring between models/ and the core)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxdist.planning.planner import PlanModel
    from models.transformer import Transformer

    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0))))
    return PlanModel(
        name=model_cfg.name,
        abstract_params=abstract,
        num_layers=model_cfg.num_layers,
        seq_len=model_cfg.seq_len,
        d_model=model_cfg.d_model,
        flops_per_token=model_cfg.flops_per_token(),
        compute_bytes=jnp.dtype(model_cfg.compute_dtype).itemsize,
        num_experts=model_cfg.num_experts,
        inventory=model_cfg.activations,
        partial_sums=model_cfg.partial_sums,
    )


def _tpu_generation(hardware: str) -> str | None:
    return hardware.removeprefix("tpu-").split("-")[0] if hardware.startswith("tpu-") else None


def run_plan(args: Plan) -> int:
    from jaxdist.planning import costmodel
    from jaxdist.planning.planner import PlanConfig, plan

    hw = costmodel.get_hardware(args.hardware)
    generation = _tpu_generation(args.hardware)
    if generation and args.verify:
        from jaxdist.planning.tpu import topology_name

        topology_name(generation, args.devices)  # a bad slice size fails before any work
    import jax

    if args.verify and not generation:
        # Fake CPU devices, one per planned device, for the ahead-of-time compiles.
        from jaxdist.mesh import setup_devices

        setup_devices(f"cpu:{args.devices}")
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config

    dtype = "float32" if hw.name == "cpu" else "bfloat16"
    # As `jaxdist train` runs it there: cuDNN's fused attention on GPUs, XLA's elsewhere.
    attention = "cudnn" if hw.name.startswith(("h100", "h200")) else "xla"
    model_cfg = get_model_config(
        args.model, compute_dtype=dtype, remat=args.remat, attention=attention
    )
    cfg = PlanConfig(
        devices=args.devices,
        hardware=args.hardware,
        batch_size=args.batch_size,
        axes=tuple(a.strip() for a in args.axes.split(",") if a.strip()),
        microbatches=args.microbatches,
        schedule=args.pipeline_schedule,
        virtual_stages=args.virtual_stages,
        compute_efficiency=args.compute_efficiency,
        max_layouts=max(args.top, args.verify),
    )
    result = plan(plan_model(model_cfg), STANDARD_RULES, cfg)
    console = Console(width=None if Console().is_terminal else 160)
    print_plan(result, console)
    if args.verify:
        devices = None
        if generation:
            from jaxdist.planning.tpu import topology_name, tpu_devices

            devices = tpu_devices(topology_name(generation, args.devices))
        else:
            devices = jax.devices()
        for row in result["layouts"][: args.verify]:
            row["verify"] = verify(row, model_cfg, STANDARD_RULES, args, devices)
        print_verify(result["layouts"][: args.verify], console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


def verify(row: dict, model_cfg, rules, args: Plan, devices) -> dict:
    """Compiles the layout's real train step for abstract inputs on `devices`."""
    import numpy as np
    from jax import ShapeDtypeStruct

    from jaxdist.mesh import MeshConfig, build_mesh
    from jaxdist.optim import OptimConfig, make_optimizer
    from jaxdist.planning import hlo, memory
    from jaxdist.step import StepConfig, build
    from models.transformer import Transformer

    mesh = build_mesh(MeshConfig(ici=tuple(row["mesh"].items())), devices)
    tx, lr = make_optimizer(OptimConfig(), 100)
    v = args.virtual_stages if args.pipeline_schedule == "interleaved" else 1
    step = StepConfig(row["microbatches"], args.pipeline_schedule, virtual_stages=v)

    def init(rngs):
        return Transformer(model_cfg, rngs)

    t0 = time.perf_counter()
    compiled = build(init, tx, lr, rules, mesh, step, 0, args.batch_size)
    batch = ShapeDtypeStruct(
        (args.batch_size, model_cfg.seq_len + 1), np.int32, sharding=compiled.batch_sharding
    )
    try:
        exe = compiled.step_fn.lower(compiled.abstract_state, batch).compile()
    except Exception as e:  # the TPU compiler refuses a step that cannot fit the chip
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return _refused(row, str(e), devices, time.perf_counter() - t0)
    mem = exe.memory_analysis()
    xla_peak = memory.xla_peak(mem)
    measured = hlo.summarize(hlo.collectives(exe.as_text(), dict(mesh.shape)))
    hlo_bytes = sum(v["bytes"] for v in measured.values())
    predicted_mem = row["memory_bytes"]["peak"]
    predicted_bytes = row["comm_bytes"]
    mem_ratio = predicted_mem / xla_peak if xla_peak else math.nan
    bytes_ratio = predicted_bytes / hlo_bytes if hlo_bytes else (1.0 if not predicted_bytes else 0)
    return {
        "platform": devices[0].platform,
        "compile_s": time.perf_counter() - t0,
        "xla_peak_bytes": xla_peak,
        "xla_temp_bytes": mem.temp_size_in_bytes,
        "predicted_peak_bytes": predicted_mem,
        "memory_ratio": mem_ratio,
        "hlo_collective_bytes": hlo_bytes,
        "predicted_collective_bytes": predicted_bytes,
        "bytes_ratio": bytes_ratio,
        "memory_ok": abs(mem_ratio - 1) <= MEMORY_TOLERANCE,
        "bytes_ok": abs(bytes_ratio - 1) <= BYTES_TOLERANCE,
    }


def _refused(row: dict, message: str, devices, seconds: float) -> dict:
    """XLA would not compile the layout for lack of memory: the planner said it fits."""
    import re

    need = re.search(r"temporaries \(([\d.]+)G\)", message)
    xla_temp = float(need.group(1)) * 2**30 if need else math.nan
    predicted = row["memory_bytes"]
    xla_peak = xla_temp + predicted["params"] + predicted["optimizer"] + predicted["batch"]
    return {
        "platform": devices[0].platform,
        "compile_s": seconds,
        "refused": message.splitlines()[0][:300],
        "xla_peak_bytes": xla_peak,
        "xla_temp_bytes": xla_temp,
        "predicted_peak_bytes": predicted["peak"],
        "memory_ratio": predicted["peak"] / xla_peak,
        "hlo_collective_bytes": math.nan,
        "predicted_collective_bytes": row["comm_bytes"],
        "bytes_ratio": math.nan,
        "memory_ok": False,
        "bytes_ok": False,
    }


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def print_plan(result: dict, console: Console) -> None:
    table = Table(
        title=f"{result['model']} on {result['devices']} x {result['hardware']}, batch "
        f"{result['batch_size']}: {len(result['layouts'])} best of {result['considered']} "
        "layouts (ms per step, predicted)"
    )
    for col in (
        "#",
        "layout",
        "mem GB",
        "T_comp/N",
        "bubble",
        "T_comm",
        "T_sync",
        "-T_overlap",
        "T_step",
        "tok/s",
        "MFU",
    ):
        table.add_column(col, justify="left" if col == "layout" else "right")
    naive = result.get("naive")
    rows = list(enumerate(result["layouts"], 1))
    if naive and all(r["layout"] != naive["layout"] for _, r in rows):
        rows.append(("naive", naive))
    for rank, r in rows:
        table.add_row(
            str(rank),
            r["layout"] + ("" if r["fits"] else " (does not fit)"),
            f"{r['memory_bytes']['peak'] / 1e9:.3g}",
            _ms(r["compute_s"]),
            _ms(r["bubble_s"]),
            _ms(r["comm_s"]),
            _ms(r["sync_s"]),
            _ms(r["overlap_s"]),
            _ms(r["step_s"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.1%}",
        )
    console.print(table)
    if result["rejected"]:
        why = ", ".join(f"{k}: {n}" for k, n in result["rejected"].items())
        console.print(f"rejected before pricing: {why}")
    if result["too_big"]:
        console.print(f"{result['too_big']} layouts priced but too big for device memory")
    best = result["layouts"][0]
    if naive and not naive["fits"]:
        console.print(
            f"naive data parallel ({naive['layout']}) does not fit: "
            f"{naive['memory_bytes']['peak'] / 1e9:.1f} GB per device; best: {best['layout']}"
        )
    elif naive and naive is not best:
        console.print(
            f"best {best['layout']} vs naive data parallel {naive['layout']}: "
            f"{naive['step_s'] / best['step_s']:.2f}x faster per step (predicted)"
        )


def _agrees(v: dict) -> bool:
    return v["memory_ok"] and v["bytes_ok"]


def print_verify(rows: list[dict], console: Console) -> None:
    table = Table(title="verify: predicted vs compiled (XLA memory analysis, HLO collectives)")
    for col in ("layout", "on", "mem pred GB", "mem XLA GB", "ratio", "comm pred MB"):
        table.add_column(col, justify="left" if col in ("layout", "on") else "right")
    for col in ("comm HLO MB", "ratio", "compile s"):
        table.add_column(col, justify="right")
    for r in rows:
        v = r["verify"]
        table.add_row(
            r["layout"],
            v["platform"],
            f"{v['predicted_peak_bytes'] / 1e9:.3f}",
            f"{v['xla_peak_bytes'] / 1e9:.3f}",
            f"{v['memory_ratio']:.3f}" + ("" if v["memory_ok"] else " FLAG"),
            f"{v['predicted_collective_bytes'] / 1e6:.2f}",
            f"{v['hlo_collective_bytes'] / 1e6:.2f}",
            f"{v['bytes_ratio']:.3f}" + ("" if v["bytes_ok"] else " FLAG"),
            f"{v['compile_s']:.1f}",
        )
    console.print(table)
    for r in rows:
        if "refused" in r["verify"]:
            console.print(f"{r['layout']}: XLA refused to compile it: {r['verify']['refused']}")
    flagged = [
        r["layout"] for r in rows if not (r["verify"]["memory_ok"] and r["verify"]["bytes_ok"])
    ]
    if flagged:
        console.print(
            f"[bold red]disagreement beyond {MEMORY_TOLERANCE:.0%} (memory) or "
            f"{BYTES_TOLERANCE:.0%} (collective bytes) on: {', '.join(flagged)}[/]"
        )
    else:
        console.print(
            f"every verified layout within {MEMORY_TOLERANCE:.0%} (memory) and "
            f"{BYTES_TOLERANCE:.0%} (collective bytes)"
        )
