"""`jaxdist checkpoints` and `jaxdist profile`: look at what a run left behind."""

import dataclasses
import json
import pathlib
from typing import Annotated

import tyro

from jaxdist.cli.options import HARDWARE_HELP


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """List the checkpoints of a run: step, size, mesh, and whether each is valid."""

    run_dir: tyro.conf.Positional[str]
    json: bool = False


def checkpoints(args: Checkpoints) -> int:
    from rich.console import Console
    from rich.table import Table

    from jaxdist.checkpoint.store import list_checkpoints

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

    path: tyro.conf.Positional[str]
    """a trace directory (jax.profiler's log dir, or a run's profile/) or one .xplane.pb"""
    json: str | None = None
    """write breakdown.json here"""
    plot: str | None = None
    """write the PNG here"""
    hardware: Annotated[str, tyro.conf.arg(help=HARDWARE_HELP)] = "cpu"
    hlo: str | None = None
    """compiled HLO text of the traced program (default: hlo.txt beside the trace)"""
    mesh: str | None = None
    """mesh as axis=size list (default: mesh.json beside the trace)"""


def profile(args: Profile) -> int:
    from jaxdist.mesh import parse_mesh
    from jaxdist.profiling import report as profile_report
    from jaxdist.profiling.xplane import find_xplane

    trace = find_xplane(args.path)
    here = pathlib.Path(args.path) if pathlib.Path(args.path).is_dir() else trace.parent
    hlo_path = pathlib.Path(args.hlo) if args.hlo else here / "hlo.txt"
    hlo_text = hlo_path.read_text() if hlo_path.exists() else None
    if args.mesh:
        mesh_shape = parse_mesh(args.mesh).sizes()
    elif (here / "mesh.json").exists():
        mesh_shape = json.loads((here / "mesh.json").read_text())
    else:
        mesh_shape = None
    report = profile_report.profile(trace, hlo_text, mesh_shape, args.hardware)
    profile_report.print_report(report)
    profile_report.write(
        report,
        pathlib.Path(args.json) if args.json else None,
        pathlib.Path(args.plot) if args.plot else None,
    )
    return 0
