"""`jaxdist` command line: typed flags (tyro) over the library, wiring models and meshes in.

The CLI is the one part of jaxdist that imports models/ and meshes/; the core never does.
"""

import dataclasses
import json
import math
import os
import pathlib
import sys
from typing import Literal

import tyro

from jaxdist.cli.plan import Plan, run_plan
from jaxdist.cli.tools import Checkpoints, Profile, checkpoints, passthrough, profile
from jaxdist.errors import ConfigError
from jaxdist.rules import batch_ways


@dataclasses.dataclass(frozen=True)
class Common:
    model: str = "tiny"
    """model preset: tiny, tiny-llama, gpt2-124m, llama-124m, 1b, llama-1b"""
    layers: int | None = None
    """override the preset's layer count (e.g. to give a pipeline more layers to cut)"""
    mesh: str = "auto"
    """mesh preset name (cpu8, single, gpu8, ...) or inline axis=size list (data=2,fsdp=4);
    auto: cpu8 on CPU, fsdp over all devices on an accelerator"""
    devices: str = "auto"
    """cpu:N for N fake CPU devices; auto uses the accelerators present, else cpu:8"""
    batch_size: int | None = None
    """global batch in rows; default 16, or one row per device of the batch axes if more"""
    seed: int = 0
    microbatches: int = 1
    """gradient accumulation: the batch is run as this many slices per step (with a pipeline
    axis: the microbatches the schedule pipelines)"""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """schedule over the pipeline mesh axis"""
    virtual_stages: int = 1
    """layer chunks per device for the interleaved schedule"""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: bfloat16 on GPU/TPU, float32 on CPU; parameters stay float32"""
    remat: Literal["none", "full", "dots"] = "none"
    """rematerialization: none, full (recompute each layer), dots (save matmul outputs)"""
    capacity_factor: float | None = None
    """MoE: expert capacity = factor x tokens x top-k / experts (tokens past it are dropped)"""
    dropless: bool = False
    """MoE: size expert buffers so that no token is ever dropped"""
    compile_cache: str = str(pathlib.Path.home() / ".cache" / "jaxdist" / "xla")
    """persistent XLA compilation cache directory, or off"""


@dataclasses.dataclass(frozen=True)
class Train(Common):
    """Train a model (the default: tiny on 8 fake CPU devices, embedded corpus)."""

    steps: int = 300
    log_every: int = 10
    run_dir: str | None = None
    """directory for config.json, metrics.jsonl, summary.json (default runs/<time>)"""
    data: str | None = None
    """a text or JSONL file (or directory of them); default: Python's stdlib sources"""
    lr: float = 3e-3
    warmup_steps: int = 20
    peak_tflops: float | None = None
    """peak TFLOP/s per device for MFU, where the device kind is not known"""
    compile_only: bool = False
    """compile the step for abstract inputs and report per-device memory; no training"""
    target: str | None = None
    """with --compile-only: compile for a TPU slice this host does not have, e.g.
    tpu-v5p:4x4x4 (needs the libtpu package: pip install 'jaxdist[tpu]')"""
    checkpoint_every: str = "auto"
    """steps between checkpoints, or auto: Young-Daly from the measured save cost and MTBF"""
    checkpoint_keep: int = 3
    mtbf_hours_per_device: float = 50_000.0
    """device MTBF for the auto interval (Llama 3 saw ~50,700 GPU-hours per interruption)"""
    nonfinite: Literal["skip", "rollback", "stop"] = "skip"
    """on a NaN/Inf loss or gradient: skip the update, roll back to the last checkpoint and
    skip past the batch, or stop"""
    fault_nan_steps: tuple[int, ...] = ()
    """fault injection, for testing recovery: make these steps' gradients NaN"""
    profile: str | None = None
    """START:STOP: trace these steps and write the step-time breakdown to the run dir"""
    watch_comm: float | None = None
    """warn when exposed communication or sync passes this fraction of a step (profiles a
    few steps every --watch-every steps)"""
    watch_every: int = 100
    coordinator: str | None = None
    """HOST:PORT of process 0, for a multi-process run (else Slurm/MPI/K8s are detected)"""
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout: int = 100
    """seconds of silence after which a peer process is declared dead"""
    slow_step_factor: float = 10.0
    """report a step slower than this many times the p50 step, naming lagging processes"""
    fault_stall: str | None = None
    """fault injection, for testing the watchdog: STEP:PROCESS:SECONDS to stall"""
    hardware: str = "auto"
    """cost-model preset for profile reports: cpu, h100-nvlink, h200-nvlink, h100-ib,
    tpu-v5p, tpu-v5e; auto picks from the devices"""


@dataclasses.dataclass(frozen=True)
class Comm(Common):
    """Compile the train step and report its collectives per mesh axis beside the analytic
    expectation."""

    json: bool = False
    """print one JSON object instead of a table"""


@dataclasses.dataclass(frozen=True)
class Bench(Common):
    """Time the real training step of a preset; print one JSON line."""

    steps: int = 30
    warmup: int = 3
    peak: float = 989.0
    """peak TFLOP/s per device for MFU (989: H100/H200 bf16 datasheet)"""


def _setup(args: Common):
    """Devices, mesh, rules and model config, all checked before anything compiles."""
    from jaxdist.mesh import setup_devices

    if getattr(args, "profile", None) or getattr(args, "watch_comm", None):
        # Op-level events in traces: XLA:CPU emits them only with this flag; on GPU, command
        # buffers (CUDA graphs) would hide the ops behind one launch.
        flags = "--xla_cpu_enable_xprof_traceme=true --xla_gpu_enable_command_buffer="
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    setup_devices(args.devices)
    if isinstance(args, Train):
        from jaxdist.cluster.join import DistributedConfig, initialize

        initialize(
            DistributedConfig(
                args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout
            ),
            cpu=True,
        )

    import jax

    if args.compile_cache != "off":
        # A restarted run (preemption, crash) then skips recompiling: restart time is part of
        # what every failure costs. Small programs too: Orbax compiles dozens on a first save.
        jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(args.compile_cache)))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    from jaxdist.mesh import build_mesh, parse_mesh
    from meshes.presets import STANDARD_RULES, get_mesh_preset
    from models.presets import get_model_config

    platform, target_devices = jax.default_backend(), None
    if getattr(args, "target", None):
        if not args.compile_only:
            raise ConfigError("--target compiles only; add --compile-only")
        from jaxdist.planning.tpu import parse_target, tpu_devices

        platform, target_devices = "tpu", tpu_devices(parse_target(args.target))
    dtype = args.compute_dtype
    if dtype == "auto":
        dtype = "float32" if platform == "cpu" else "bfloat16"
    moe = {}
    if args.capacity_factor is not None or args.dropless:
        if not get_model_config(args.model).num_experts:
            raise ConfigError(
                f"--capacity-factor/--dropless apply to MoE models; {args.model} "
                "has no experts (try --model tiny-moe)"
            )
        moe["dropless"] = args.dropless
        if args.capacity_factor is not None:
            moe["capacity_factor"] = args.capacity_factor
    model_cfg = get_model_config(
        args.model,
        **moe,
        compute_dtype=dtype,
        remat=args.remat,
        **({"num_layers": args.layers} if args.layers else {}),
        # cuDNN's fused attention takes 16-bit inputs only.
        attention="cudnn" if platform == "gpu" and dtype == "bfloat16" else "xla",
    )
    if args.mesh == "auto":
        rules = STANDARD_RULES
        mesh_cfg = get_mesh_preset("cpu8").mesh if platform == "cpu" else parse_mesh("fsdp=-1")
    else:
        preset = get_mesh_preset(args.mesh)
        mesh_cfg, rules = preset.mesh, preset.rules
    mesh = build_mesh(mesh_cfg, target_devices)
    if args.batch_size is None:
        ways = math.prod(mesh.shape[a] for a in rules.mesh_axes("batch", "activation"))
        args = dataclasses.replace(args, batch_size=max(16, ways * args.microbatches))
    return mesh, rules, model_cfg, args


def _step_config(args: Common, **extra):
    from jaxdist.step import StepConfig

    return StepConfig(
        microbatches=args.microbatches,
        pipeline_schedule=args.pipeline_schedule,
        virtual_stages=args.virtual_stages,
        **extra,
    )


def _stall(text: str | None) -> tuple[int, int, float] | None:
    if text is None:
        return None
    try:
        step, process, seconds = text.split(":")
        return int(step), int(process), float(seconds)
    except ValueError:
        raise ConfigError(f"--fault-stall {text!r} is not STEP:PROCESS:SECONDS") from None


def train(args: Train) -> int:
    mesh, rules, model_cfg, args = _setup(args)
    import jax

    from jaxdist import train as loop
    from jaxdist.checkpoint.interval import CheckpointConfig
    from jaxdist.data import DataConfig
    from jaxdist.optim import OptimConfig
    from models.presets import model_spec

    model = model_spec(model_cfg)
    optim = OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup_steps)
    data = DataConfig(path=args.data, batch_size=args.batch_size, seed=args.seed)
    step = _step_config(args, fault_nan_steps=args.fault_nan_steps)
    from jaxdist.profiling.capture import parse_range

    hardware = args.hardware
    if hardware == "auto":
        kind = jax.devices()[0].device_kind
        hardware = (
            "h200-nvlink"
            if "H200" in kind
            else "h100-nvlink"
            if "H100" in kind
            else "tpu-v5p"
            if "v5p" in kind
            else "tpu-v5e"
            if "v5" in kind
            else "cpu"
        )
    cfg = loop.LoopConfig(
        steps=args.steps,
        log_every=args.log_every,
        run_dir=args.run_dir,
        peak_tflops=args.peak_tflops,
        seed=args.seed,
        nonfinite=args.nonfinite,
        profile=parse_range(args.profile) if args.profile else None,
        watch_comm=args.watch_comm,
        watch_every=args.watch_every,
        hardware=hardware,
        slow_step_factor=args.slow_step_factor,
        fault_stall=_stall(args.fault_stall),
    )
    ckpt = CheckpointConfig(
        every=args.checkpoint_every,
        keep=args.checkpoint_keep,
        mtbf_hours_per_device=args.mtbf_hours_per_device,
    )
    ckpt.validate()
    if args.compile_only:
        from jaxdist.optim import make_optimizer
        from jaxdist.step import build

        # No data: the batch is abstract (and a target's hosts are not this one).
        tx, lr = make_optimizer(optim, cfg.steps)
        compiled = build(model.init, tx, lr, rules, mesh, step, cfg.seed, args.batch_size)
        report = loop.compile_only(compiled, args.batch_size, model_cfg.seq_len)
        report |= {"model": model.name, "params": compiled.num_params, "mesh": dict(mesh.shape)}
        if args.target:
            report |= _target_fit(args.target, report, model, args.batch_size, mesh.size)
        print(json.dumps(report))
        return 0
    loop.run(model, mesh, rules, optim, data, step, cfg, ckpt)
    return 0


def _target_fit(target: str, report: dict, model, batch_size: int, devices: int) -> dict:
    """Whether the step fits a chip of the target, and XLA's FLOPs beside the model's."""
    from jaxdist.planning.costmodel import get_hardware

    hw = get_hardware(target.split(":")[0])
    ours = model.flops_per_token * batch_size * model.seq_len / devices
    return {
        "chip_memory_bytes": hw.memory_bytes,
        "fits": report["per_device_bytes"]["peak_estimate"] <= hw.memory_bytes,
        "model_flops_per_device": ours,
        "xla_over_model_flops": report["xla_flops"] / ours if report["xla_flops"] else None,
    }


def _pipeline_expected(args, model_cfg, compiled, mesh) -> dict:
    """The pipeline's permute bytes, from its schedule and one microbatch's activation (and,
    interleaved, the layer chunks moved into place and their gradients back)."""
    import jax.numpy as jnp

    from jaxdist.parallel import pipeline

    if mesh.shape["pipeline"] == 1:
        return {}
    schedule = pipeline.make_schedule(
        args.pipeline_schedule, mesh.shape["pipeline"], args.microbatches, args.virtual_stages
    )
    rows = args.batch_size // args.microbatches // batch_ways(compiled.batch_sharding)
    act = rows * model_cfg.seq_len * model_cfg.d_model * jnp.dtype(model_cfg.compute_dtype).itemsize
    layers = pipeline.layer_shard_bytes(compiled.abstract_state.params)
    return {("pipeline", "collective-permute"): pipeline.permute_bytes(schedule, act, layers)}


def comm(args: Comm) -> int:
    mesh, rules, model_cfg, args = _setup(args)
    import jax.numpy as jnp

    from jaxdist.optim import OptimConfig, make_optimizer
    from jaxdist.planning import traffic as comm_report
    from jaxdist.step import build
    from models.presets import model_spec

    model = model_spec(model_cfg)
    tx, lr = make_optimizer(OptimConfig(), 100)
    compiled = build(
        model.init, tx, lr, rules, mesh, _step_config(args), args.seed, args.batch_size
    )
    report = comm_report.report(
        compiled,
        mesh,
        rules,
        args.batch_size,
        model_cfg.seq_len,
        model_cfg.partial_sums(
            args.batch_size, args.microbatches, batch_ways(compiled.batch_sharding)
        ),
        compute_bytes=jnp.dtype(model_cfg.compute_dtype).itemsize,
        microbatches=args.microbatches,
        extra_expected=_pipeline_expected(args, model_cfg, compiled, mesh),
    )
    if args.json:
        print(json.dumps(report))
    else:
        comm_report.print_table(report)
    return 0


def bench(args: Bench) -> int:
    mesh, rules, model_cfg, args = _setup(args)
    from jaxdist import train as loop
    from jaxdist.data import DataConfig
    from jaxdist.optim import OptimConfig
    from jaxdist.profiling.bench import bench as run_bench
    from jaxdist.step import StepConfig
    from models.presets import model_spec

    model = model_spec(model_cfg)
    data = DataConfig(batch_size=args.batch_size, seed=args.seed)
    cfg = loop.LoopConfig(steps=args.steps + args.warmup + 1, seed=args.seed)
    compiled, batches = loop.prepare(
        model, mesh, rules, OptimConfig(), data, StepConfig(microbatches=args.microbatches), cfg
    )
    print(
        json.dumps(
            run_bench(compiled, batches, model, args.batch_size, args.steps, args.warmup, args.peak)
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    from jaxdist.checkpoint.recovery import TrainingStopped

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("launch", "slurm", "k8s"):
        try:
            return passthrough(argv)
        except ConfigError as e:
            print(f"jaxdist: error: {e}", file=sys.stderr)
            return 2

    args = tyro.extras.subcommand_cli_from_dict(
        {
            "train": Train,
            "comm": Comm,
            "bench": Bench,
            "checkpoints": Checkpoints,
            "profile": Profile,
            "plan": Plan,
        },
        args=argv,
        prog="jaxdist",
        description="Also: jaxdist launch|slurm|k8s [options] -- train [train options] "
        "(several processes on this host; a Slurm script; a Kubernetes JobSet).",
    )
    try:
        commands = {
            Train: train,
            Comm: comm,
            Bench: bench,
            Checkpoints: checkpoints,
            Profile: profile,
            Plan: run_plan,
        }
        return commands[type(args)](args)
    except ConfigError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"jaxdist: stopped: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
