"""Launch files for real clusters: a Slurm batch script and a Kubernetes JobSet."""

import pathlib
import posixpath
import re
import shlex
import sys

import yaml

from jaxdist.errors import ConfigError

INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Where a JobSet's pods mount the run volume, unless told otherwise.
RUN_MOUNT = "/runs"
BUILD_IMAGE = "docker build -f jaxdist/cluster/Dockerfile -t IMAGE . (from the repository's root)"
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


# The restart loop's shell, after RUN_DIR, MAX_RESTARTS and attempt() (see _restart_loop).
_RESTART_SH = r"""# srun's line about a failed task, e.g. "srun: error: node7: task 1: Killed"
TASK_LINE='^srun: error: [^ ]+: tasks? [0-9,-]+: '

# jaxdist.cluster.restarts.cause's words for an exit code: ended WHO CODE
ended() {
  local sig
  if (($2 == 124)); then
    echo "$1 exited 124: a hang was declared"
  elif (($2 == 143)); then
    echo "$1 exited 143: a signal's save was not reached in time"
  elif (($2 > 128)) && sig=$(kill -l $(($2 - 128)) 2>/dev/null); then
    echo "$1 killed by SIG$sig"
  else
    echo "$1 exited with code $2"
  fi
}

# Why srun exited CODE, into CAUSE; STOPPED=1 if the first task that failed ended by a SIGTERM
# (killed by it, or exited 143: its save after it came too late), a request to stop: why CODE
why() {
  local line re=': (tasks? [0-9,-]+): (.*)$' who what code
  line=$(head -n 1 "$REPORT")
  STOPPED=0
  if ! [[ $line =~ $re ]]; then
    what="no task's failure reported: srun's own error, above"
    (($1 <= 128 && $1 != 124)) || what=$(ended "a task" "$1")
    (($1 != 143)) || STOPPED=1
    CAUSE="srun exited $1 ($what)"
    return
  fi
  who=${BASH_REMATCH[1]} what=${BASH_REMATCH[2]}
  case $what in
    "Exited with exit code "*)
      code=${what##* }
      what=$(ended "$who" "$code")
      ((code != 143)) || STOPPED=1
      ;;
    Killed*) what="$who killed by SIGKILL" ;;
    Terminated*) what="$who killed by SIGTERM" STOPPED=1 ;;
    *) what="$who: $what" ;;
  esac
  CAUSE="srun exited $1 ($what)"
}

# The restart's line of RUN_DIR/restarts.jsonl: record RESTART
record() {
  local cause=${CAUSE//\\/\\\\}
  mkdir -p "$RUN_DIR"
  printf '{"time": %s, "restart": %d, "max_restarts": %d, "cause": "%s", "by": "slurm"}\n' \
    "$(date +%s.%N)" "$1" "$MAX_RESTARTS" "${cause//\"/\\\"}" >>"$RUN_DIR/restarts.jsonl"
}

REPORT=$(mktemp)
trap 'rm -f "$REPORT"' EXIT
# A SIGTERM to this script (scancel, a preemption) ends the loop once srun has returned.
STOP=0
trap 'STOP=1' TERM
exec 3>&1
restart=0
while true; do
  code=0
  attempt || code=$?
  ((code != 0)) || exit 0
  why "$code"
  n=$((restart + 1))
  if ((STOP || STOPPED)); then
    echo "jaxdist: attempt $n: $CAUSE; not restarted: a SIGTERM asks to stop" >&2
    exit "$code"
  elif ((restart == MAX_RESTARTS)); then
    echo "jaxdist: attempt $n: $CAUSE; not restarted: no restarts left of $MAX_RESTARTS" >&2
    exit "$code"
  fi
  restart=$n
  echo "jaxdist: attempt $n: $CAUSE; restart $restart of $MAX_RESTARTS" >&2
  record "$restart"
done"""


def sbatch(
    nodes: int,
    gpus_per_node: int,
    train_args: list[str],
    job_name: str = "jaxdist",
    time_limit: str = "24:00:00",
    cpu_devices_per_task: int = 4,
    max_restarts: int = 0,
    env: str | None = None,
) -> str:
    """One task per GPU (or, with no GPUs, one CPU task per node with fake devices).

    `env`: the Python environment (a venv or conda prefix) the tasks activate before they run
    jaxdist; default: the one this process runs in (`activation`), so the job runs the
    jaxdist that printed it.

    Inside `srun`, JAX's Slurm detection finds the coordinator, the process count and id;
    SIGTERM 120 s before the time limit makes every task save and exit 0, and `--requeue` with
    the same run directory resumes.

    With `max_restarts` > 0 the script runs srun again, in the same allocation, after it fails:
    a task that exited non-zero or was killed (and the others, which srun then stops), or a
    hang a task declared (exit 124); each restart resumes from the newest good checkpoint and
    is one line of RUN_DIR/restarts.jsonl (jaxdist.cluster.restarts). Not restarted: exit 0
    (done, or saved at the time limit's SIGTERM), a failure that began with a SIGTERM (a
    request to stop), and a node that dies: that takes the allocation, and is --requeue's.
    """
    if max_restarts < 0:
        raise ConfigError(
            f"--max-restarts {max_restarts} is negative; pass 0 (no restarts) or more"
        )
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
        *activation(env),
        "set -euo pipefail",
        "",
    ]
    args = list(train_args)
    if not gpus_per_node and "--devices" not in args:
        args += ["--devices", f"cpu:{cpu_devices_per_task}"]
    rest, given = split_run_dir(args)
    # Every task must name the same directory, and a requeued job keeps its id, so the rerun
    # resumes it (relative to the submission directory, which srun starts in).
    run_dir = '"runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"' if given is None else shlex.quote(given)
    if max_restarts:
        cmd = f'{_command(rest)} --run-dir "$RUN_DIR"'
        lines += _restart_loop(cmd, run_dir, max_restarts)
    else:
        cmd = _command(args) + (f" --run-dir {run_dir}" if given is None else "")
        lines.append(f"srun --kill-on-bad-exit=1 {cmd}")
    return "\n".join(lines) + "\n"


def activation(env: str | None = None) -> list[str]:
    """The script's lines that activate Python environment `env` (a venv's or a conda env's
    prefix; default: this interpreter's), with a comment saying which; before `set -u`, which
    conda's activation scripts do not survive. A system Python: a comment, nothing run."""
    prefix = pathlib.Path(env or sys.prefix)
    conda = (prefix / "conda-meta").is_dir()
    venv = (prefix / "bin" / "activate").is_file() and (env or sys.prefix != sys.base_prefix)
    if env is not None and not (conda or venv):
        raise ConfigError(f"{env} holds no bin/activate; pass a venv's or a conda env's prefix")
    if not (conda or venv):
        return ["# No virtual environment: the tasks run the python on the nodes' PATH."]
    said = "the environment `jaxdist slurm` ran in" if env is None else "this environment"
    lines = [
        f"# Each task runs jaxdist from {said} (its path must be the same on",
        "# the nodes; edit the line below where they see it elsewhere).",
    ]
    if conda:
        quoted = shlex.quote(str(prefix))
        return [*lines, f'eval "$(conda shell.bash hook)" && conda activate {quoted}']
    return [*lines, f"source {shlex.quote(str(prefix / 'bin' / 'activate'))}"]


def _command(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["python", "-m", "jaxdist.cli", *args])


def split_run_dir(args: list[str]) -> tuple[list[str], str | None]:
    """The train arguments without their --run-dir, and its value (None if not given)."""
    rest, given, i = [], None, 0
    while i < len(args):
        if args[i] == "--run-dir" and i + 1 < len(args):
            given, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--run-dir="):
            given = args[i].partition("=")[2]
        else:
            rest.append(args[i])
        i += 1
    return rest, given


def _restart_loop(cmd: str, run_dir: str, max_restarts: int) -> list[str]:
    """The script's end with restarts: the run directory and srun's command, then the loop."""
    return [
        "# Run srun again after it fails, up to MAX_RESTARTS times, each recorded in",
        "# RUN_DIR/restarts.jsonl (the format of jaxdist.cluster.restarts).",
        f"RUN_DIR={run_dir}",
        f"MAX_RESTARTS={max_restarts}",
        "",
        "# One srun; its stderr goes on to the script's, and srun's own lines about failed tasks",
        "# (the first one is the cause: --kill-on-bad-exit stops the others) into REPORT.",
        "attempt() {",
        f"  srun --kill-on-bad-exit=1 {cmd} 2>&1 >&3 \\",
        '    | tee >(cat >&2) | grep --line-buffered -E "$TASK_LINE" >"$REPORT"',
        '  return "${PIPESTATUS[0]}"',
        "}",
        "",
        _RESTART_SH,
    ]


def jobset(
    hosts: int,
    train_args: list[str],
    image: str,
    run_volume: str,
    gpus_per_host: int = 8,
    name: str = "jaxdist",
    port: int = 1234,
    run_mount: str = RUN_MOUNT,
    max_restarts: int = 3,
) -> str:
    """A JobSet of `hosts` indexed pods; pod 0 is the coordinator, reached by its stable DNS
    name, and each pod's completion index is its process id. Every pod mounts the claim
    `run_volume` at `run_mount`, where the run directory must lie: checkpoints outlive the
    pods, and the set, restarted whole after a lost pod (up to `max_restarts` times), resumes
    from them."""
    if max_restarts < 0:
        raise ConfigError(
            f"--max-restarts {max_restarts} is negative; pass 0 (no restarts) or more"
        )
    check_k8s(image, run_volume)
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
    manifest = jobset_doc(name, hosts, pod, max_restarts)
    header = (
        f"# jaxdist on {hosts} pods: kubectl apply -f THIS_FILE\n"
        f"# image: {BUILD_IMAGE.replace('IMAGE', image)}\n"
        f"# the claim {run_volume} (ReadWriteMany) must exist: the run directory is on it\n"
    )
    return header + yaml.safe_dump(manifest, sort_keys=False)


def check_k8s(image: str, run_volume: str) -> None:
    """An image named, and a claim's name that Kubernetes takes; else one line naming the fix."""
    if not image.strip():
        raise ConfigError(f"--image is empty; build one: {BUILD_IMAGE}")
    if not _K8S_NAME.fullmatch(run_volume):
        raise ConfigError(
            f"--run-volume {run_volume!r} is not a PersistentVolumeClaim name (lower-case "
            "letters, digits, '-' and '.'); pass the name of an existing ReadWriteMany claim"
        )


def jobset_doc(name: str, hosts: int, pod: dict, max_restarts: int = 3) -> dict:
    """A JobSet of `hosts` indexed pods of `pod`, restarted whole up to `max_restarts` times."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            # A lost pod fails the set; it restarts whole and resumes from the checkpoint.
            "failurePolicy": {"maxRestarts": max_restarts},
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
