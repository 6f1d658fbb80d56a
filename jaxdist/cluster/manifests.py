"""Launch files for real clusters: a Slurm batch script and a Kubernetes JobSet."""

import shlex

import yaml

INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


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
    lines.append(f"srun --kill-on-bad-exit=1 {cmd}")
    return "\n".join(lines) + "\n"


def jobset(
    hosts: int,
    train_args: list[str],
    image: str = "jaxdist:latest",
    gpus_per_host: int = 8,
    name: str = "jaxdist",
    port: int = 1234,
) -> str:
    """A JobSet of `hosts` indexed pods; pod 0 is the coordinator, reached by its stable DNS
    name, and each pod's completion index is its process id."""
    coordinator = f"{name}-workers-0-0.{name}:{port}"
    args = [
        *train_args,
        "--coordinator",
        coordinator,
        "--num-processes",
        str(hosts),
        "--process-id",
        "$(JOB_COMPLETION_INDEX)",
    ]
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
    }
    if gpus_per_host:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_host}}
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
                            "template": {
                                "spec": {"restartPolicy": "Never", "containers": [container]}
                            },
                        }
                    },
                }
            ],
        },
    }
    return yaml.safe_dump(manifest, sort_keys=False)
