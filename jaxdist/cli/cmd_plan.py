"""`jaxdist plan`: rank layouts for a model on N devices, and verify the best against XLA."""

import dataclasses
import json
from typing import Annotated

import tyro

from jaxdist import hardware as hardware_table
from jaxdist.cli.options import MODEL_HELP, Common, model_config
from jaxdist.cli.plan_print import (
    check_target,
    print_command,
    print_plan,
    print_verify,
    train_command,
)
from jaxdist.errors import ConfigError
from jaxdist.layout import REPLICA, SEARCHED_AXES
from jaxdist.metrics.progress import console_for

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
    """Rank the layouts of a model on N devices by predicted step time (memory must fit),
    times the tokens replica groups need for data parallelism's loss where there are any.

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
    axes: str = ",".join(SEARCHED_AXES)
    """mesh axes the planner may use (context splits the sequence: it ranks first only where
    rows are too few or too long; replica, not searched by default: groups that train alone
    and meet every --sync-every steps, DiLoCo)"""
    compute_efficiency: float | None = None
    """one flat share of peak for every FLOP instead of the hardware's calibrated figures"""
    top: int = 10
    """layouts shown, fastest first"""
    verify: int = 0
    """compile the top K layouts ahead of time (for TPU hardware a TPU topology, for H100/H200
    the GPU compiler (jaxdist[gpu-aot]), else fake CPU devices) and set XLA's memory and
    collective bytes beside the predictions"""
    json: str | None = None
    """also write the plan as JSON to this file, the command to run its first choice among it
    ("command"); -: the JSON alone on stdout, instead of the table"""
    wide: bool = False
    """every column: the fleet law's terms apart (communication and its overlap), tokens/s"""
    replicas: int | None = None
    """also rank layouts of this many replica groups that train alone and meet every
    --sync-every steps (DiLoCo; --sync-dtype, --sync-fragments, --sync-delay) beside the
    others, by the time to data parallelism's loss: the step time times the tokens M groups
    need for it (arXiv:2503.09799's loss at M groups, measured at H = 30); or add replica to
    --axes for any number of groups"""
    link_gbps: float | None = None
    """the slow link (between hosts or TPU slices; the hardware's, e.g. 400 on h100) at this
    many Gbit/s per device and direction: for a cluster across buildings, the link between
    them divided by the devices on one side (a 100 Gb/s link to 64 GPUs: 1.5625)"""


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
    from jaxdist.compiled import gpu

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
    from jaxdist.planning.inputs import PlanConfig
    from meshes.presets import get_mesh_preset

    mesh = ()
    if args.mesh != "auto":
        mesh = tuple(get_mesh_preset(args.mesh).mesh.sizes().items())
    axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
    if args.replicas is not None and REPLICA not in axes:
        axes = (REPLICA, *axes)
    return PlanConfig(
        devices=devices,
        hardware=args.hardware,
        batch_size=args.batch_size,
        step=args.step,
        axes=axes,
        compute_efficiency=args.compute_efficiency,
        max_layouts=max(args.top, args.verify),
        mesh=mesh,
        sync=args.sync,
        replicas=args.replicas or 0,
        link_gbps=args.link_gbps,
    )


def _check_sync(args: Plan, cfg, layers: int) -> None:
    """The replica flags, before any pricing: --replicas a divisor of the devices, and the
    sync flags only where some layout has replica groups, each within its bounds."""

    M = args.replicas
    if M is not None and (M < 2 or cfg.devices % M):
        raise ConfigError(
            f"--replicas {M} must be at least 2 and divide the {cfg.devices} devices; e.g. "
            "--replicas 2"
        )
    grouped = REPLICA in cfg.axes or dict(cfg.mesh).get(REPLICA, 1) > 1
    if not grouped:
        changed = args.sync.changed_flags()
        if changed:
            raise ConfigError(
                f"{', '.join(changed)} set(s) how replica groups meet, and the plan has none: "
                "add --replicas M (or replica to --axes, or to --mesh), or drop the flag"
            )
        return
    args.sync.validate(M or dict(cfg.mesh).get(REPLICA, 1), layers)


def _check_verify(args: Plan, hw, devices: int):
    """The compile targets `--verify` needs, checked before any work: (TPU generation or None,
    GPU target or None); fake CPU devices, one per planned device, otherwise."""
    generation = _tpu_generation(hw)
    if generation and args.verify:
        from jaxdist.compiled import tpu

        if args.slices > 1:
            raise ConfigError("--verify compiles one TPU slice; drop --slices or --verify")
        tpu.topology_name(generation, devices)  # a bad slice size fails before any work
        if tpu.missing():
            raise ConfigError(tpu.missing())
    gpu_target = _gpu_target(hw, devices) if args.verify else None
    if args.verify and not generation and not gpu_target:
        from jaxdist.mesh import setup_devices

        setup_devices(f"cpu:{devices}")
    return generation, gpu_target


def _targets(generation, gpu_target, devices: int) -> list:
    if generation:
        from jaxdist.compiled.tpu import topology_name, tpu_devices

        return tpu_devices(topology_name(generation, devices))
    if gpu_target:
        from jaxdist.compiled.gpu import gpu_devices

        return gpu_devices(gpu_target)
    import jax

    return jax.devices()


def run(args: Plan) -> int:
    from jaxdist.hardware import get_hardware
    from jaxdist.planning.planner import plan

    args.validate()
    hw = get_hardware(args.hardware)
    if args.link_gbps is not None:
        hardware_table.with_slow_link(hw, args.link_gbps)  # a bad figure fails before any work
    devices = _devices(args, hw)
    args = dataclasses.replace(args, devices=devices)
    generation, gpu_target = _check_verify(args, hw, devices)
    from meshes.presets import STANDARD_RULES
    from models.inventory import plan_model

    # As `jaxdist train` builds it there: its dtype, cuDNN's fused attention on GPUs, splash
    # on TPUs, the flags' sizes and remat.
    model_cfg = model_config(args, hw.platform)
    policies = [model_cfg.remat]
    if args.remat == "auto":  # each layout takes the fastest policy that fits it
        from models.remat import ORDER

        policies = list(ORDER)
    configs = [dataclasses.replace(model_cfg, remat=p) for p in policies]
    models = [plan_model(c) for c in configs]
    cfg = _plan_config(args, devices)
    _check_sync(args, cfg, models[0].num_layers)
    result = plan(models, STANDARD_RULES, cfg)
    console = console_for(stderr=False)  # to a file or pipe: no line wrapped
    result["best"] = 0
    if args.verify:
        _verify(args, model_cfg, result, _targets(generation, gpu_target, devices))
    best = result["layouts"][result["best"]] if result["best"] is not None else None
    result["command"] = train_command(args, best) if best else None
    result["check_target"] = check_target(result, hw) if best else None
    if args.json == "-":  # the plan alone on stdout, as `train --compile-only --json -` does
        print(json.dumps(result, default=str))
        return 0 if best else 1
    print_plan(result, console, args.wide)
    if args.verify:
        print_verify(result, console, hw.platform)
    print_command(result, console, result["check_target"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if best else 1


def _verify(args: Plan, model_cfg, result: dict, targets: list) -> None:
    """Compiles the top --verify layouts; the first that fits once compiled becomes the plan's
    choice (`result["best"]`: its index, None where none does)."""
    from jaxdist.compiled.aot import verify
    from jaxdist.planning.layouts import layout_of
    from meshes.presets import STANDARD_RULES
    from models.presets import model_spec

    cfg = _plan_config(args, args.devices)
    result["best"] = None
    for i, row in enumerate(result["layouts"][: args.verify]):
        sizes = {a: n for a, n in row["mesh"].items() if n > 1}
        layout = layout_of(sizes, STANDARD_RULES, cfg, row["seq_len"], row["remat"])
        model = model_spec(dataclasses.replace(model_cfg, remat=row["remat"]))
        row["verify"] = verify(row, model, layout, targets)
        if result["best"] is None and row["verify"]["fits"]:
            result["best"] = i
