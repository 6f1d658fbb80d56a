"""`jaxdist` commands that do not train: checkpoint listing, trace reports, and launching
(on this host, or as Slurm and Kubernetes files). They sit on top of the library like the rest
of the CLI."""

import dataclasses
import json
import pathlib
import sys
from typing import Literal

import tyro


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
    hardware: str = "cpu"
    """cost-model preset for the model columns and the projection"""
    hlo: str | None = None
    """compiled HLO text of the traced program (default: hlo.txt beside the trace)"""
    mesh: str | None = None
    """mesh as axis=size list (default: mesh.json beside the trace)"""


def profile(args: Profile) -> int:
    from jaxdist.mesh import parse_mesh
    from jaxdist.profiling import report as profile_report
    from jaxdist.profiling.trace import find_xplane

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
    report = profile_report.analyze(trace, hlo_text, mesh_shape, args.hardware)
    profile_report.print_report(report)
    profile_report.write(
        report,
        pathlib.Path(args.json) if args.json else None,
        pathlib.Path(args.plot) if args.plot else None,
    )
    return 0


@dataclasses.dataclass(frozen=True)
class Launch:
    """Run `train` as N processes on this host over loopback:
    jaxdist launch --processes 2 --devices-per-process 4 -- train --model tiny ..."""

    processes: int = 2
    devices_per_process: int = 4
    platform: Literal["cpu", "gpu"] = "cpu"
    """cpu: fake CPU devices per process; gpu: that many local GPUs per process"""
    port: int | None = None


@dataclasses.dataclass(frozen=True)
class Slurm:
    """Print an sbatch script for a run: jaxdist slurm --nodes 2 --gpus-per-node 8 -- train ..."""

    nodes: int = 1
    gpus_per_node: int = 8
    """0: CPU tasks with fake devices (one per node)"""
    time: str = "24:00:00"
    job_name: str = "jaxdist"


@dataclasses.dataclass(frozen=True)
class K8s:
    """Print a Kubernetes JobSet manifest for a run: jaxdist k8s --hosts 4 -- train ..."""

    hosts: int = 2
    gpus_per_host: int = 8
    image: str = "jaxdist:latest"
    name: str = "jaxdist"


def passthrough(argv: list[str]) -> int:
    """Commands that carry a train command line after `--`."""
    name, rest = argv[0], argv[1:]
    if "--" not in rest:
        print(
            f"jaxdist: error: {name} needs the train command after --, e.g. "
            f"jaxdist {name} ... -- train --model tiny",
            file=sys.stderr,
        )
        return 2
    cut = rest.index("--")
    own, train_args = rest[:cut], rest[cut + 1 :]
    kind = {"launch": Launch, "slurm": Slurm, "k8s": K8s}[name]
    args = tyro.cli(kind, args=own, prog=f"jaxdist {name}")
    if train_args and train_args[0] != "train":
        train_args = ["train", *train_args]
    if isinstance(args, Launch):
        from jaxdist.cluster.launch import launch

        return launch(
            args.processes, args.devices_per_process, train_args, args.platform, args.port
        )
    from jaxdist.cluster import manifests as cluster_files

    if isinstance(args, Slurm):
        print(
            cluster_files.sbatch(
                args.nodes, args.gpus_per_node, train_args, args.job_name, args.time
            ),
            end="",
        )
    else:
        print(
            cluster_files.jobset(args.hosts, train_args, args.image, args.gpus_per_host, args.name),
            end="",
        )
    return 0
