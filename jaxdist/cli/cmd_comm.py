"""`jaxdist comm`: the collectives XLA compiled into the step, per mesh axis, beside what the
layout implies (jaxdist.compiled.comm_report)."""

import dataclasses
import json

import tyro

from jaxdist.cli.options import Common, setup
from jaxdist.config import OptimConfig


@dataclasses.dataclass(frozen=True)
class Comm(Common):
    """Compile the train step and report its collectives per mesh axis beside the analytic
    expectation."""

    optim: tyro.conf.OmitArgPrefixes[OptimConfig] = OptimConfig()
    seed: int = 0
    """seeds the model's initial weights (the collectives do not depend on it)"""
    json: bool = False
    """print one JSON object instead of a table"""


def run(args: Comm) -> int:
    mesh, layout, model_cfg, args = setup(args)
    from jaxdist.compiled import comm_report
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build
    from models.inventory import plan_model
    from models.presets import model_spec

    model = model_spec(model_cfg)
    tx, lr = make_optimizer(args.optim, 100)
    jitted = build(model.init, tx, lr, layout, mesh, args.seed)
    report = comm_report.report(jitted, plan_model(model_cfg), layout, args.optim.optimizer)
    if args.json:
        print(json.dumps(report))
    else:
        comm_report.print_table(report)
    return 0
