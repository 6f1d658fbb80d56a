"""`jaxdist plan`: rank layouts for a model on N devices, and verify the best against XLA."""

import dataclasses
import json
from typing import Annotated, Literal

import tyro
from rich.console import Console
from rich.table import Table

from jaxdist.cli.options import HARDWARE_HELP, MODEL_HELP
from jaxdist.errors import ConfigError
from jaxdist.planning.aot import BYTES_TOLERANCE, MEMORY_TOLERANCE


@dataclasses.dataclass(frozen=True)
class Plan:
    """Rank the layouts of a model on N devices by predicted step time (memory must fit)."""

    model: Annotated[str, tyro.conf.arg(help=MODEL_HELP)] = "1b"
    devices: int = 64
    hardware: Annotated[str, tyro.conf.arg(help=HARDWARE_HELP)] = "h100"
    batch_size: int = 512
    axes: str = "pipeline,data,fsdp,expert,tensor"
    """mesh axes the planner may use"""
    microbatches: int = 0
    """0: none without a pipeline, 4 per stage with one"""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """pipeline schedule priced for layouts with a pipeline axis"""
    virtual_stages: int = 2
    """layer chunks per device, for the interleaved schedule"""
    remat: Literal["preset", "none", "full", "dots"] = "preset"
    """rematerialization: preset (the model preset's own), none, full or dots"""
    compute_efficiency: float = 0.5
    """share of peak FLOP/s the matmuls reach (0.4-0.6 on well-tuned GPUs and TPUs)"""
    top: int = 10
    verify: int = 0
    """compile the top K layouts ahead of time (for TPU hardware a TPU topology, for H100/H200
    the GPU compiler (jaxdist[gpu-aot]), else fake CPU devices) and set XLA's memory and
    collective bytes beside the predictions"""
    json: str | None = None
    """also write the plan as JSON to this file"""


def _tpu_generation(hardware: str) -> str | None:
    return hardware.removeprefix("tpu-").split("-")[0] if hardware.startswith("tpu-") else None


def _gpu_target(hw, devices: int):
    """The GPU target `--verify` compiles for (hosts of the preset's size), None for CPU
    hardware. Without the CUDA plugin, or for a GPU without a target config, a ConfigError."""
    from jaxdist.planning import gpu

    if hw.platform != "gpu":
        return None
    if hw.name not in gpu.KINDS:
        # Fake CPU devices cannot stand in: the plan prices cuDNN's attention, which XLA:CPU
        # does not have.
        raise ConfigError(
            f"--verify compiles for GPUs with a target config ({', '.join(gpu.KINDS)}); "
            f"{hw.name} has none: drop --verify, or plan for --hardware h100"
        )
    per_host = min(devices, hw.devices_per_host)
    if devices % per_host:
        raise ConfigError(
            f"--devices {devices}: {hw.name} hosts hold {per_host} GPUs; use a multiple of it"
        )
    gpu.prepare()
    return gpu.GpuTarget(hw.name, devices // per_host, per_host)


def run(args: Plan) -> int:
    from jaxdist.hardware import get_hardware
    from jaxdist.planning.planner import PlanConfig, plan

    hw = get_hardware(args.hardware)
    generation = _tpu_generation(args.hardware)
    if generation and args.verify:
        from jaxdist.planning import tpu

        tpu.topology_name(generation, args.devices)  # a bad slice size fails before any work
        if tpu.missing():
            raise ConfigError(tpu.missing())
    gpu_target = _gpu_target(hw, args.devices) if args.verify else None
    import jax

    if args.verify and not generation and not gpu_target:
        # Fake CPU devices, one per planned device, for the ahead-of-time compiles.
        from jaxdist.mesh import setup_devices

        setup_devices(f"cpu:{args.devices}")
    from meshes.presets import STANDARD_RULES
    from models.inventory import plan_model
    from models.presets import get_model_config, model_spec

    dtype = "float32" if hw.platform == "cpu" else "bfloat16"
    # As `jaxdist train` runs it there: cuDNN's fused attention on GPUs, splash on TPUs.
    attention = {"gpu": "cudnn", "tpu": "splash"}.get(hw.platform, "xla")
    remat = {} if args.remat == "preset" else {"remat": args.remat}
    model_cfg = get_model_config(args.model, compute_dtype=dtype, attention=attention, **remat)
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
        elif gpu_target:
            from jaxdist.planning.gpu import gpu_devices

            devices = gpu_devices(gpu_target)
        else:
            devices = jax.devices()
        from jaxdist.planning.aot import verify

        v = args.virtual_stages if args.pipeline_schedule == "interleaved" else 1
        for row in result["layouts"][: args.verify]:
            row["verify"] = verify(
                row,
                model_spec(model_cfg),
                STANDARD_RULES,
                args.batch_size,
                args.pipeline_schedule,
                v,
                devices,
            )
        print_verify(result["layouts"][: args.verify], console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


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
