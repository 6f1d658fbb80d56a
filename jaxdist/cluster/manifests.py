"""Launch files for real clusters: a Slurm batch script and a Kubernetes JobSet."""

import posixpath
import re
import shlex

import yaml

from jaxdist.errors import ConfigError

INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Where a JobSet's pods mount the run volume, unless told otherwise.
RUN_MOUNT = "/runs"
BUILD_IMAGE = "docker build -f jaxdist/cluster/Dockerfile -t IMAGE . (from the repository's root)"
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def sbatch(
    nodes: int,
    gpus_per_node: int,
    train_args: list[str],
    job_name: str = "jaxdist",
    time_limit: str = "24:00:00",
    cpu_devices_per_task: int = 4,
) -> str:
    """One task per GPU (or, with no GPUs, one CPU task per node with fake devices).

    Inside `srun`, JAX's Slurm detection finds the coordinator, the process count and id;
    SIGTERM 120 s before the time limit makes every task save and exit 0, and `--requeue` with
    the same run directory resumes.
    """
    tasks = gpus_per_node if gpus_per_node else 1
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
    ]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += [
        f"#SBATCH --time={time_limit}",
        "#SBATCH --signal=TERM@120",
        "#SBATCH --requeue",
        "#SBATCH --output=%x-%j.out",
        "set -euo pipefail",
        "",
    ]
    args = list(train_args)
    if not gpus_per_node and "--devices" not in args:
        args += ["--devices", f"cpu:{cpu_devices_per_task}"]
    cmd = " ".join(shlex.quote(a) for a in ["python", "-m", "jaxdist.cli", *args])
    if not any(a == "--run-dir" or a.startswith("--run-dir=") for a in args):
        # Every task must name the same directory, and a requeued job keeps its id, so the
        # rerun resumes it (relative to the submission directory, which srun starts in).
        cmd += ' --run-dir "runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"'
    lines.append(f"srun --kill-on-bad-exit=1 {cmd}")
    return "\n".join(lines) + "\n"


def jobset(
    hosts: int,
    train_args: list[str],
    image: str,
    run_volume: str,
    gpus_per_host: int = 8,
    name: str = "jaxdist",
    port: int = 1234,
    run_mount: str = RUN_MOUNT,
) -> str:
    """A JobSet of `hosts` indexed pods; pod 0 is the coordinator, reached by its stable DNS
    name, and each pod's completion index is its process id. Every pod mounts the claim
    `run_volume` at `run_mount`, where the run directory must lie: checkpoints outlive the
    pods, and the set, restarted whole after a lost pod, resumes from them."""
    if not image.strip():
        raise ConfigError(f"--image is empty; build one: {BUILD_IMAGE}")
    if not _K8S_NAME.fullmatch(run_volume):
        raise ConfigError(
            f"--run-volume {run_volume!r} is not a PersistentVolumeClaim name (lower-case "
            "letters, digits, '-' and '.'); pass the name of an existing ReadWriteMany claim"
        )
    run_mount = posixpath.normpath(run_mount)
    coordinator = f"{name}-workers-0-0.{name}:{port}"
    args = [
        *_on_volume(train_args, run_mount, name),
        "--coordinator",
        coordinator,
        "--num-processes",
        str(hosts),
        "--process-id",
        "$(JOB_COMPLETION_INDEX)",
    ]
    pod = _pod(image, args, port, gpus_per_host, run_volume, run_mount)
    manifest = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            # A lost pod fails the set; it restarts whole and resumes from the checkpoint.
            "failurePolicy": {"maxRestarts": 3},
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": hosts,
                            "completions": hosts,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {"spec": pod},
                        }
                    },
                }
            ],
        },
    }
    header = (
        f"# jaxdist on {hosts} pods: kubectl apply -f THIS_FILE\n"
        f"# image: {BUILD_IMAGE.replace('IMAGE', image)}\n"
        f"# the claim {run_volume} (ReadWriteMany) must exist: the run directory is on it\n"
    )
    return header + yaml.safe_dump(manifest, sort_keys=False)


def _pod(
    image: str, args: list[str], port: int, gpus: int, run_volume: str, run_mount: str
) -> dict:
    """One worker: the image running `jaxdist train`, the run volume mounted."""
    container = {
        "name": "jaxdist",
        "image": image,
        "command": ["python", "-m", "jaxdist.cli"],
        "args": args,
        "ports": [{"containerPort": port}],
        "env": [
            {
                "name": "JOB_COMPLETION_INDEX",
                "valueFrom": {"fieldRef": {"fieldPath": INDEX_ANNOTATION}},
            }
        ],
        "volumeMounts": [{"name": "run", "mountPath": run_mount}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    return {
        "restartPolicy": "Never",
        # SIGTERM saves at the next step boundary: give it the time Slurm's script gives
        # (--signal=TERM@120), not Kubernetes' default 30 s, before the SIGKILL.
        "terminationGracePeriodSeconds": 150,
        "containers": [container],
        "volumes": [{"name": "run", "persistentVolumeClaim": {"claimName": run_volume}}],
    }


def _on_volume(train_args: list[str], mount: str, name: str) -> list[str]:
    """The train arguments with their --run-dir on the run volume (RUN_MOUNT/NAME if none is
    given: a default run directory, named by the time, would differ in every restarted pod)."""
    given = None
    for i, a in enumerate(train_args):
        if a == "--run-dir" and i + 1 < len(train_args):
            given = train_args[i + 1]
        elif a.startswith("--run-dir="):
            given = a.partition("=")[2]
    if not posixpath.isabs(mount):
        raise ConfigError(f"--run-mount {mount} must be an absolute path, e.g. {RUN_MOUNT}")
    if given is None:
        return [*train_args, "--run-dir", posixpath.join(mount, name)]
    run_dir = posixpath.normpath(given)
    if not posixpath.isabs(run_dir) or posixpath.commonpath([mount, run_dir]) != mount:
        raise ConfigError(
            f"--run-dir {given} is not on the run volume, mounted at {mount}: its checkpoints "
            f"would die with the pod; pass --run-dir {posixpath.join(mount, name)} (or "
            "--run-mount a directory that holds the run directory)"
        )
    return list(train_args)
