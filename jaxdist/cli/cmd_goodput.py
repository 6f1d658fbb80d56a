"""`jaxdist goodput`: where a run's wall-clock went, over every attempt
(jaxdist.metrics.goodput)."""

import dataclasses
import json
import pathlib
from typing import Annotated

import tyro


@dataclasses.dataclass(frozen=True)
class Goodput:
    """Account for a run's time from its first start to its last record: productive steps,
    compile, restore, checkpoints, recomputed steps, data, eval, startup, time between
    attempts; goodput = productive / wall-clock."""

    run_dir: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="RUN_DIR")]
    json: bool = False
    """print the accounting as JSON instead of a table"""
    plot: Annotated[str | None, tyro.conf.arg(metavar="PNG")] = None
    """write a stacked bar per attempt to this PNG"""


def goodput(args: Goodput) -> int:
    from jaxdist.groups import accounting as fleet
    from jaxdist.metrics import goodput as accounting

    if fleet.is_fleet(args.run_dir):  # launch --groups: the fleet's rounds and faults
        rep = fleet.fleet_report(args.run_dir)
        if args.json:
            print(json.dumps(rep))
        else:
            fleet.print_fleet(rep)
        return 0
    rep = accounting.read_report(pathlib.Path(args.run_dir))
    if args.json:
        print(json.dumps(rep))
    else:
        accounting.print_report(rep)
    if args.plot:
        accounting.plot(rep, pathlib.Path(args.plot))
    return 0
