"""`jaxdist bench`: the real training step of a preset, timed (jaxdist.profiling.bench)."""

import dataclasses
import json

from jaxdist.cli.options import Common, setup


@dataclasses.dataclass(frozen=True)
class Bench(Common):
    """Time the real training step of a preset; print one JSON line."""

    seed: int = 0
    steps: int = 30
    warmup: int = 3
    peak: float = 989.0
    """peak TFLOP/s per device for MFU (989: H100/H200 bf16 datasheet)"""


def run(args: Bench) -> int:
    mesh, rules, model_cfg, args = setup(args)
    from jaxdist import train as loop
    from jaxdist.data import DataConfig
    from jaxdist.profiling.bench import bench
    from jaxdist.step import StepConfig
    from models.presets import model_spec

    model = model_spec(model_cfg)
    data = DataConfig(batch_size=args.batch_size, seed=args.seed)
    config = loop.RunConfig(
        data=data,
        step=StepConfig(microbatches=args.step.microbatches),
        loop=loop.LoopConfig(steps=args.steps + args.warmup + 1, seed=args.seed),
    )
    jitted, batches = loop.prepare(model, mesh, rules, config)
    result = bench(jitted, batches, model, args.batch_size, args.steps, args.warmup, args.peak)
    print(json.dumps(result))
    return 0
