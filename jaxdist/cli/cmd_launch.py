"""`jaxdist launch|slurm|k8s OPTIONS -- train ...`: a run as several processes on this host, or
as a Slurm script or a Kubernetes JobSet. They carry a train command line after `--`."""

import dataclasses
import sys
from typing import Annotated, Literal

import tyro

from jaxdist.cluster import manifests


@dataclasses.dataclass(frozen=True)
class Launch:
    """Run `train` as N processes on this host over loopback:
    jaxdist launch --processes 2 --devices-per-process 4 -- train --model tiny ..."""

    processes: int = 2
    """processes started on this host, one run"""
    devices_per_process: int = 4
    """devices each process drives (see --platform)"""
    platform: Literal["cpu", "gpu"] = "cpu"
    """cpu: fake CPU devices per process; gpu: that many local GPUs per process"""
    port: int | None = None
    """the coordinator's port on loopback (default: a free one)"""
    max_restarts: int = 0
    """after a failure (an exit, a kill, a declared hang) start every process again, up to N
    times; each attempt resumes from the newest good checkpoint (needs --run-dir); with
    --groups, a failed group alone, up to N times per group"""
    groups: int | None = None
    """M replica groups, each its own job of --processes processes (the train command's --mesh
    replica=M,...: each group the rest of the mesh), meeting every --sync-every steps through
    torchft (--sync-fragments, --sync-delay and --sync-dtype as in one program, the groups'
    changes summed in float64 on the host); a lost group restarts alone and heals from a live
    peer"""
    ft_python: str | None = None
    """with --groups: the Python 3.11 interpreter the torchft sidecars run in (pip install
    torch==2.13.0 torchft==0.2.0 numpy); default $JAXDIST_FT_PYTHON"""
    ft_host: str = "127.0.0.1"
    """with --groups: the address every torchft socket binds (the lighthouse, the managers, Gloo)"""
    lighthouse: str | None = None
    """with --groups: HOST:PORT of a running torchft lighthouse; default: launch starts one and
    starts it again if it dies"""
    min_groups: int | None = None
    """with --groups: the fewest groups a round commits with (default: a majority)"""
    heartbeat_timeout: float = 3.0
    """with --groups: seconds without a group's heartbeat before the quorum drops it"""
    join_timeout: float = 10.0
    """with --groups: seconds a round's quorum waits for a live group that has not joined it"""
    collective_timeout: float = 10.0
    """with --groups: seconds an all-reduce or a heal's transfer may take before the round fails"""


@dataclasses.dataclass(frozen=True)
class Slurm:
    """Print an sbatch script for a run, whose tasks activate the Python environment (venv or
    conda) this command runs in: jaxdist slurm --nodes 2 --gpus-per-node 8 -- train ...
    With --groups M, a script to run with bash that submits a lighthouse job and a job array
    of M groups (jaxdist slurm --groups 2 --nodes 1 -- train --mesh replica=2,data=8
    --run-dir runs/a ... > fleet.sh && bash fleet.sh); each group its own jax.distributed job
    over --nodes nodes, restarted alone up to --max-restarts times."""

    nodes: int = 1
    """hosts in the allocation (with --groups: in each group's)"""
    gpus_per_node: int = 8
    """0: CPU tasks with fake devices (one per node)"""
    time: str = "24:00:00"
    """the job's wall-clock limit, as sbatch --time takes it"""
    job_name: str = "jaxdist"
    """sbatch --job-name"""
    max_restarts: int = 0
    """after a failed srun (an exit, a kill, a declared hang) run it again, up to N times, in
    the same allocation; each attempt resumes from the newest good checkpoint; with --groups,
    a failed group's alone, up to N times per group"""
    groups: int | None = None
    """M replica groups, each a job array element of --nodes nodes (the train command's --mesh
    replica=M,...: each group the rest of the mesh), meeting every --sync-every steps through
    torchft; a lighthouse job of its own outlives any group"""
    ft_python: str | None = None
    """with --groups: the sidecars' and lighthouse's Python 3.11 interpreter, at the same path
    on the nodes (pip install torch==2.13.0 torchft==0.2.0 numpy); default $JAXDIST_FT_PYTHON"""
    ft_host: str | None = None
    """with --groups: the address the torchft sockets bind (default: each node's first
    address, `hostname -I`)"""
    lighthouse: str | None = None
    """with --groups: HOST:PORT of a running torchft lighthouse (default: a job starts one)"""
    min_groups: int | None = None
    """with --groups: the fewest groups a round commits with (default: a majority)"""
    heartbeat_timeout: float = 3.0
    """with --groups: seconds without a group's heartbeat before the quorum drops it"""
    join_timeout: float = 10.0
    """with --groups: seconds a round's quorum waits for a live group that has not joined it"""
    collective_timeout: float = 10.0
    """with --groups: seconds an all-reduce or a heal's transfer may take before the round fails"""


@dataclasses.dataclass(frozen=True)
class K8s:
    """Print a Kubernetes JobSet manifest for a run: jaxdist k8s --image IMAGE --run-volume
    CLAIM --hosts 4 -- train ... (build IMAGE from this repository: docker build -f
    jaxdist/cluster/Dockerfile -t IMAGE . and push it where the cluster pulls from). With
    --groups M: a lighthouse Deployment and Service, and a JobSet of --hosts pods per group,
    each restarted alone up to --max-restarts times (--ft-python names the image's torchft
    interpreter)."""

    image: Annotated[str, tyro.conf.arg(metavar="IMAGE")]
    """the container image with jaxdist installed: docker build -f jaxdist/cluster/Dockerfile
    -t IMAGE . (from the repository's root), then push it"""
    run_volume: Annotated[str, tyro.conf.arg(metavar="CLAIM")]
    """a PersistentVolumeClaim every pod mounts at --run-mount (ReadWriteMany): the run
    directory lives there, so checkpoints outlive the pods and a restarted set resumes"""
    run_mount: str = manifests.RUN_MOUNT
    """where the claim is mounted; the train command's --run-dir must lie under it (without
    one, it is --run-mount/--name: /runs/jaxdist by default)"""
    hosts: int = 2
    """pods, one process each"""
    gpus_per_host: int = 8
    """GPUs each pod asks for (0: none); one process per pod, pod 0 coordinates"""
    name: str = "jaxdist"
    """the JobSet's name (its pods' names start with it; with --groups, NAME-gG per group)"""
    max_restarts: int = 3
    """restarts of the JobSet after a lost pod, each resuming from the newest checkpoint; with
    --groups, of each group's JobSet alone"""
    groups: int | None = None
    """M replica groups, each a JobSet of --hosts pods (the train command's --mesh
    replica=M,...: each group the rest of the mesh), meeting every --sync-every steps through
    torchft's lighthouse, a Deployment of its own"""
    ft_python: str | None = None
    """with --groups: the torchft interpreter in IMAGE (a Python 3.11 with torch==2.13.0
    torchft==0.2.0 numpy); default $JAXDIST_FT_PYTHON"""
    lighthouse: str | None = None
    """with --groups: http://HOST:PORT of a running torchft lighthouse (default: a Deployment)"""
    min_groups: int | None = None
    """with --groups: the fewest groups a round commits with (default: a majority)"""
    heartbeat_timeout: float = 3.0
    """with --groups: seconds without a group's heartbeat before the quorum drops it"""
    join_timeout: float = 10.0
    """with --groups: seconds a round's quorum waits for a live group that has not joined it"""
    collective_timeout: float = 10.0
    """with --groups: seconds an all-reduce or a heal's transfer may take before the round fails"""


def passthrough(argv: list[str]) -> int:
    """Commands that carry a train command line after `--`."""
    name, rest = argv[0], argv[1:]
    kind = {"launch": Launch, "slurm": Slurm, "k8s": K8s}[name]
    own = rest[: rest.index("--")] if "--" in rest else rest
    if "-h" in own or "--help" in own:
        tyro.cli(kind, args=["--help"], prog=f"jaxdist {name}")  # prints the help, exits 0
    if "--" not in rest:
        print(
            f"jaxdist: error: {name} needs the train command after --, e.g. "
            f"jaxdist {name} ... -- train --model tiny",
            file=sys.stderr,
        )
        return 2
    train_args = rest[rest.index("--") + 1 :]
    args = tyro.cli(kind, args=own, prog=f"jaxdist {name}")
    if train_args and train_args[0] != "train":
        train_args = ["train", *train_args]
    if isinstance(args, Launch) and args.groups is not None:
        from jaxdist.groups.fleet import FleetConfig, launch_groups

        fleet = FleetConfig(
            args.groups, args.ft_python, args.ft_host, args.lighthouse, args.min_groups,
            args.heartbeat_timeout, args.join_timeout, args.collective_timeout,
        )  # fmt: skip
        return launch_groups(
            fleet, args.processes, args.devices_per_process, train_args, args.platform,
            args.max_restarts,
        )  # fmt: skip
    if isinstance(args, Launch):
        from jaxdist.cluster.launch import launch

        return launch(
            args.processes,
            args.devices_per_process,
            train_args,
            args.platform,
            args.port,
            max_restarts=args.max_restarts,
        )
    if isinstance(args, (Slurm, K8s)) and args.groups is not None:
        print(_fleet_files(args, train_args), end="")
        return 0
    if isinstance(args, Slurm):
        print(
            manifests.sbatch(
                args.nodes,
                args.gpus_per_node,
                train_args,
                args.job_name,
                args.time,
                max_restarts=args.max_restarts,
            ),
            end="",
        )
    else:
        print(
            manifests.jobset(
                args.hosts,
                train_args,
                args.image,
                args.run_volume,
                args.gpus_per_host,
                args.name,
                run_mount=args.run_mount,
                max_restarts=args.max_restarts,
            ),
            end="",
        )
    return 0


def _fleet_files(args: "Slurm | K8s", train_args: list[str]) -> str:
    """`jaxdist slurm|k8s --groups M`: the fleet's launch files (jaxdist.groups.fleet_slurm,
    fleet_k8s), checked as `jaxdist launch --groups M` checks its fleet."""
    from jaxdist.groups.fleet import FleetConfig

    fleet = FleetConfig(
        args.groups, args.ft_python, getattr(args, "ft_host", None) or "", args.lighthouse,
        args.min_groups, args.heartbeat_timeout, args.join_timeout, args.collective_timeout,
    )  # fmt: skip
    if isinstance(args, Slurm):
        from jaxdist.groups.fleet_slurm import slurm_fleet

        return slurm_fleet(
            fleet, args.nodes, args.gpus_per_node, train_args, args.job_name, args.time,
            args.max_restarts,
        )  # fmt: skip
    from jaxdist.groups.fleet_k8s import k8s_fleet

    return k8s_fleet(
        fleet, args.hosts, train_args, args.image, args.run_volume, args.gpus_per_host,
        args.name, args.run_mount, args.max_restarts,
    )  # fmt: skip
