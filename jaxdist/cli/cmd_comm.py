"""`jaxdist comm`: the collectives XLA compiled into the step, per mesh axis, beside what the
layout implies (jaxdist.planning.traffic)."""

import dataclasses
import json

from jaxdist.cli.options import Common, setup


@dataclasses.dataclass(frozen=True)
class Comm(Common):
    """Compile the train step and report its collectives per mesh axis beside the analytic
    expectation."""

    seed: int = 0
    json: bool = False
    """print one JSON object instead of a table"""


def run(args: Comm) -> int:
    mesh, rules, model_cfg, args = setup(args)
    import jax.numpy as jnp

    from jaxdist.optim import OptimConfig, make_optimizer
    from jaxdist.parallel import pipeline
    from jaxdist.parallel.context import carrier
    from jaxdist.planning import traffic
    from jaxdist.rules import batch_ways
    from jaxdist.rules import ways as split_ways
    from jaxdist.step import build
    from models.inventory import partial_sums
    from models.presets import model_spec

    model = model_spec(model_cfg)
    tx, lr = make_optimizer(OptimConfig(), 100)
    step = (args.step, args.seed, args.batch_size)
    jitted = build(model.init, tx, lr, rules, mesh, *step, seq_len=model.seq_len)
    ways = batch_ways(jitted.batch_sharding)
    dtype_bytes = jnp.dtype(model_cfg.compute_dtype).itemsize
    extra, share, stages, virtual = {}, None, mesh.shape["pipeline"], 1
    if stages > 1:
        step = args.step
        schedule = pipeline.make_schedule(
            step.pipeline_schedule, mesh.shape["pipeline"], step.microbatches, step.virtual_stages
        )
        act = pipeline.microbatch_bytes(
            args.batch_size,
            step.microbatches,
            ways,
            model_cfg.seq_len // split_ways(mesh.shape, rules.mesh_axes("seq", "activation")),
            model_cfg.d_model,
            dtype_bytes,
        )
        extra[("pipeline", "collective-permute")] = pipeline.send_bytes(
            schedule, jitted.abstract_state.params, rules, dict(mesh.shape), act, dtype_bytes
        )
        share, virtual = pipeline.branch_share(schedule), schedule.virtual
    platform = mesh.devices.flat[0].platform
    report = traffic.report(
        jitted,
        mesh,
        rules,
        args.batch_size,
        model_cfg.seq_len,
        partial_sums(
            *(model_cfg, args.batch_size, args.step.microbatches, ways, stages, virtual),
            context=(
                carrier(args.step.context_strategy, platform, stages > 1),
                split_ways(mesh.shape, rules.mesh_axes("seq", "activation")),
            ),
            platform=platform,
        ),
        compute_bytes=dtype_bytes,
        microbatches=args.step.microbatches,
        extra_expected=extra,
        collective_matmul=args.step.collective_matmul,
        fused_loss=args.step.loss_chunk_tokens > 0,
        branch_share=share,
    )
    if args.json:
        print(json.dumps(report))
    else:
        traffic.print_table(report)
    return 0
