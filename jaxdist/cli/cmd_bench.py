"""`jaxdist bench`: the real training step of a preset, timed (jaxdist.profiling.bench)."""

import dataclasses
import json

from jaxdist.cli.options import Common, check_host_memory, setup
from jaxdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Bench(Common):
    """Time the real training step of a preset; print one JSON line."""

    seed: int = 0
    """seeds the model's initial weights and the data order"""
    steps: int = 30
    """timed steps (their p50/p90 are reported)"""
    warmup: int = 3
    """untimed steps first: compilation and the allocator's warm-up stay out of the times"""
    peak_tflops: float | None = None
    """peak TFLOP/s per device for MFU; default: the hardware table's for the devices present
    (none for CPUs: mfu is then null)"""


def run(args: Bench) -> int:
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ConfigError(f"--peak-tflops {args.peak_tflops} must be > 0")
    for flag, value in (("--steps", args.steps), ("--warmup", args.warmup)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    mesh, layout, model_cfg, args = setup(args)
    check_host_memory(mesh, layout, model_cfg)
    from jaxdist import train as loop
    from jaxdist.config import DataConfig, LoopConfig, RunConfig
    from jaxdist.profiling.bench import bench
    from models.presets import model_spec

    model = model_spec(model_cfg)
    data = DataConfig(batch_size=args.batch_size, seed=args.seed)
    config = RunConfig(
        data=data,
        step=args.step,
        loop=LoopConfig(steps=args.steps + args.warmup + 1, seed=args.seed),
    )
    jitted, batches = loop.prepare(model, mesh, layout.rules, config)
    result = bench(
        jitted, batches, model, args.batch_size, args.steps, args.warmup, args.peak_tflops
    )
    print(json.dumps(result))
    return 0
