"""`jaxdist checkpoints` and `jaxdist profile`: look at what a run left behind."""

import dataclasses
import json
import pathlib
from typing import Annotated

import tyro

from jaxdist.cli.options import HARDWARE_HELP
from jaxdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """List the checkpoints of a run: step, size, mesh, and whether each is valid."""

    run_dir: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="RUN_DIR")]
    """a run directory (train's --run-dir)"""
    json: bool = False
    """print one JSON list of the checkpoints instead of a table"""


def checkpoints(args: Checkpoints) -> int:
    from rich.console import Console
    from rich.table import Table

    from jaxdist.checkpoint.damage import list_checkpoints

    rows = list_checkpoints(pathlib.Path(args.run_dir))
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table(title=f"checkpoints in {args.run_dir}")
    for col in ("step", "name", "MB", "mesh", "valid", "note"):
        table.add_column(col)
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in (r["mesh"] or {}).items() if v > 1) or "-"
        table.add_row(
            str(r["step"]),
            r["name"],
            f"{r['bytes'] / 1e6:.2f}",
            mesh,
            "yes" if r["valid"] else "NO",
            r["why"],
        )
    Console().print(table)
    return 0


@dataclasses.dataclass(frozen=True)
class Profile:
    """Attribute a JAX trace's step time to compute, communication (exposed and hidden), sync
    and idle, per step and device."""

    path: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="PATH")]
    """a run directory (its profile/), a trace directory (jax.profiler's log dir) or one
    .xplane.pb"""
    json: str | None = None
    """write breakdown.json here (-: to stdout, instead of the table)"""
    plot: str | None = None
    """write the PNG here"""
    hardware: Annotated[
        str | None,
        tyro.conf.arg(help=f"{HARDWARE_HELP}; default: the run's (saved beside the trace), or cpu"),
    ] = None
    hlo: str | None = None
    """compiled HLO text of the traced program (default: hlo.txt in the trace's log dir)"""
    mesh: str | None = None
    """mesh as axis=size list (default: mesh.json in the trace's log dir)"""


def profile(args: Profile) -> int:
    from jaxdist.mesh import parse_mesh
    from jaxdist.metrics.progress import console_for
    from jaxdist.profiling import report as profile_report

    hlo_text = None
    if args.hlo:
        if not pathlib.Path(args.hlo).is_file():
            raise ConfigError(
                f"--hlo {args.hlo} does not exist; pass the traced program's compiled HLO text "
                "(a run's profile/hlo.txt)"
            )
        hlo_text = pathlib.Path(args.hlo).read_text()
    mesh_shape = parse_mesh(args.mesh).sizes() if args.mesh else None
    report = profile_report.profile_saved(args.path, args.hardware, hlo_text, mesh_shape)
    to_stdout = args.json == "-"  # as plan's and train --compile-only's --json take it
    if to_stdout:
        print(json.dumps(report, indent=1))
    else:
        # The consoles a run's own report prints on: to a file or pipe, nothing wrapped or cut.
        profile_report.print_report(report, console_for(stderr=False), console_for(stderr=True))
    profile_report.write(
        report,
        pathlib.Path(args.json) if args.json and not to_stdout else None,
        pathlib.Path(args.plot) if args.plot else None,
    )
    return 0
