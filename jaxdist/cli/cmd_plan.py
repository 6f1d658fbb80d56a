"""`jaxdist plan`: rank layouts for a model on N devices, and verify the best against XLA."""

import dataclasses
import json
from typing import Annotated

import tyro
from rich.console import Console
from rich.table import Table

from jaxdist import hardware as hardware_table
from jaxdist.cli.options import MODEL_HELP, Common, model_config
from jaxdist.errors import ConfigError
from jaxdist.planning.aot import BYTES_TOLERANCE, MEMORY_TOLERANCE
from jaxdist.planning.planner import DEFAULT_AXES

PLAN_HARDWARE_HELP = (
    f"hardware preset ({', '.join(hardware_table.PRESETS)}), or a Google Cloud TPU slice as "
    "its console names it: v5p-16 is 8 chips (v4 and v5p names count 2 TensorCores a chip), "
    "v5e-256 (or v5litepod-256) 256, v6e-8 8"
)
PLAN_MESH_HELP = (
    "auto: rank every layout of --axes; or price one layout alone, a mesh preset or "
    "axis=size list (fsdp=8,tensor=2)"
)


@dataclasses.dataclass(frozen=True)
class Plan(Common):
    """Rank the layouts of a model on N devices by predicted step time (memory must fit).

    The model, its size flags, remat and the step's microbatches and pipeline schedule are
    `jaxdist train`'s: plan what you will run."""

    model: Annotated[str, tyro.conf.arg(help=MODEL_HELP)] = "1b"
    mesh: Annotated[str, tyro.conf.arg(help=PLAN_MESH_HELP)] = "auto"
    devices: int | None = None
    """devices to plan for; default: the --hardware slice's chips (times --slices), else 64"""
    hardware: Annotated[str, tyro.conf.arg(help=PLAN_HARDWARE_HELP)] = "h100"
    slices: int = 1
    """TPU multi-slice: this many --hardware slices (a Google Cloud name such as v5p-128),
    joined by DCN"""
    batch_size: Annotated[int, tyro.conf.arg(help="global batch in rows")] = 512
    axes: str = ",".join(DEFAULT_AXES)
    """mesh axes the planner may use (context splits the sequence: it ranks first only where
    rows are too few or too long)"""
    compute_efficiency: float | None = None
    """one flat share of peak for every FLOP instead of the hardware's calibrated figures"""
    top: int = 10
    verify: int = 0
    """compile the top K layouts ahead of time (for TPU hardware a TPU topology, for H100/H200
    the GPU compiler (jaxdist[gpu-aot]), else fake CPU devices) and set XLA's memory and
    collective bytes beside the predictions"""
    json: str | None = None
    """also write the plan as JSON to this file"""


def _devices(args: Plan, hw) -> int:
    """The device count: a Google Cloud slice name gives it (times --slices), or --devices."""
    if args.slices < 1:
        raise ConfigError(f"--slices {args.slices} must be at least 1")
    if not hw.slice_name:
        if args.slices != 1:
            raise ConfigError(
                "--slices counts TPU slices: name one with --hardware, e.g. --hardware v5p-128"
            )
        return 64 if args.devices is None else args.devices
    chips = hw.devices_per_host * args.slices
    if args.devices is not None and args.devices != chips:
        of = f"{args.slices} x {hw.slice_name}" if args.slices > 1 else hw.slice_name
        raise ConfigError(
            f"--devices {args.devices} contradicts --hardware {hw.slice_name} ({of} is {chips} "
            "chips): drop --devices, or use --slices for more slices"
        )
    return chips


def _tpu_generation(hw) -> str | None:
    return hw.name.removeprefix("tpu-") if hw.platform == "tpu" else None


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


def _plan_config(args: Plan, devices: int):
    """The planner's settings from the flags: `jaxdist train`'s step settings, and one layout
    (--mesh) or every split over --axes."""
    from jaxdist.planning.planner import PlanConfig
    from meshes.presets import get_mesh_preset

    layout = ()
    if args.mesh != "auto":
        layout = tuple(get_mesh_preset(args.mesh).mesh.sizes().items())
    return PlanConfig(
        devices=devices,
        hardware=args.hardware,
        batch_size=args.batch_size,
        axes=tuple(a.strip() for a in args.axes.split(",") if a.strip()),
        # 1 (train's default) with a pipeline axis would leave stages idle: the planner's own
        # default then, 4 microbatches per stage.
        microbatches=args.step.microbatches if args.step.microbatches > 1 else 0,
        schedule=args.step.pipeline_schedule,
        virtual_stages=args.step.virtual_stages,
        compute_efficiency=args.compute_efficiency,
        max_layouts=max(args.top, args.verify),
        loss_chunk_tokens=args.step.loss_chunk_tokens,
        context_strategy=args.step.context_strategy,
        collective_matmul=args.step.collective_matmul,
        layout=layout,
    )


def run(args: Plan) -> int:
    from jaxdist.hardware import get_hardware
    from jaxdist.planning.planner import plan

    args.validate()
    hw = get_hardware(args.hardware)
    devices = _devices(args, hw)
    args = dataclasses.replace(args, devices=devices)
    generation = _tpu_generation(hw)
    if generation and args.verify:
        from jaxdist.planning import tpu

        if args.slices > 1:
            raise ConfigError("--verify compiles one TPU slice; drop --slices or --verify")
        tpu.topology_name(generation, devices)  # a bad slice size fails before any work
        if tpu.missing():
            raise ConfigError(tpu.missing())
    gpu_target = _gpu_target(hw, devices) if args.verify else None
    import jax

    if args.verify and not generation and not gpu_target:
        # Fake CPU devices, one per planned device, for the ahead-of-time compiles.
        from jaxdist.mesh import setup_devices

        setup_devices(f"cpu:{devices}")
    from meshes.presets import STANDARD_RULES
    from models.inventory import plan_model
    from models.presets import model_spec

    # As `jaxdist train` builds it there: its dtype, cuDNN's fused attention on GPUs, splash
    # on TPUs, the flags' sizes and remat.
    model_cfg = model_config(args, hw.platform)
    cfg = _plan_config(args, devices)
    policies = [model_cfg.remat]
    if args.remat == "auto":  # each layout takes the fastest policy that fits it
        from jaxdist.cli.remat_auto import order

        policies = list(order())
    configs = [dataclasses.replace(model_cfg, remat=p) for p in policies]
    result = plan([plan_model(c) for c in configs], STANDARD_RULES, cfg)
    console = Console(width=None if Console().is_terminal else 160)
    print_plan(result, console)
    if args.verify:
        targets = None
        if generation:
            from jaxdist.planning.tpu import topology_name, tpu_devices

            targets = tpu_devices(topology_name(generation, args.devices))
        elif gpu_target:
            from jaxdist.planning.gpu import gpu_devices

            targets = gpu_devices(gpu_target)
        else:
            targets = jax.devices()
        from jaxdist.planning.aot import verify

        for row in result["layouts"][: args.verify]:
            row["verify"] = verify(
                row,
                model_spec(dataclasses.replace(model_cfg, remat=row["remat"])),
                STANDARD_RULES,
                args.batch_size,
                args.step,
                targets,
            )
        print_verify(result["layouts"][: args.verify], console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def print_plan(result: dict, console: Console) -> None:
    if result.get("slice"):
        chips = result["devices_per_host"]
        slices = result["devices"] // chips
        across = f"; {slices} slices joined by DCN" if slices > 1 else ""
        console.print(f"{result['slice']}: {chips} chips{across}")
    if result.get("machine"):
        per_host = result["devices_per_host"]
        hosts = -(-result["devices"] // per_host)
        console.print(
            f"{result['machine']}: {per_host} {result['hardware'].upper()} per host, {hosts} "
            f"hosts, {result['between_hosts_bytes_s'] / 1e9:g} GB/s per GPU between them"
        )
    table = Table(
        title=f"{result['model']} on {result['devices']} x {result['hardware']}, batch "
        f"{result['batch_size']}: {len(result['layouts'])} best of {result['considered']} "
        "layouts (ms per step, predicted)"
    )
    for col in (
        "#",
        "layout",
        "remat",
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
        table.add_column(col, justify="left" if col in ("layout", "remat") else "right")
    naive = result.get("naive")
    rows = list(enumerate(result["layouts"], 1))
    if naive and all(r["layout"] != naive["layout"] for _, r in rows):
        rows.append(("naive", naive))
    for rank, r in rows:
        table.add_row(
            str(rank),
            r["layout"] + ("" if r["fits"] else " (does not fit)"),
            r["remat"],
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
