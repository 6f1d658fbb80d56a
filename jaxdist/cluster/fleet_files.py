"""Launch files for a fleet of replica groups (`jaxdist slurm|k8s --groups M`): a torchft
lighthouse and M groups, each its own `jax.distributed` job running the train command with the
same per-group mesh (its --mesh without `replica=M`), each restarted alone, the lighthouse
restarted beside them. What `jaxdist launch --groups M` does on one host (jaxdist.groups.fleet),
in a cluster's own terms:

- Slurm: a submit script that queues the lighthouse as a small job of its own and the groups
  as one job array of M elements (each element a group, its restarts the single job's loop);
- Kubernetes: the lighthouse as a Deployment behind a Service, and a JobSet per group (its
  failurePolicy.maxRestarts the group's restarts).

A group's processes learn who they are from JAXDIST_GROUP (jaxdist.groups.member.Settings, as
JSON): its id, the lighthouse's address, the address its torchft store binds, the sidecar's
interpreter. The checks are the local launcher's (jaxdist.groups.fleet.group_args).
"""

import dataclasses
import json
import os
import posixpath
import re
import shlex
from collections.abc import Callable
from typing import NamedTuple

import yaml

from jaxdist.cluster import manifests
from jaxdist.errors import ConfigError
from jaxdist.groups.bridge import FT_PACKAGES, FT_PYTHON_VAR, ft_python
from jaxdist.groups.fleet import FleetConfig, group_args
from jaxdist.groups.member import ENV, Settings

# Files in the fleet's run directory through which the Slurm jobs find each other.
LIGHTHOUSE_FILE = "lighthouse.slurm"  # "LIGHTHOUSE_JOB_ID http://HOST:PORT", by the lighthouse
GROUPS_FILE = "groups.slurm"  # "LIGHTHOUSE_JOB_ID GROUPS_JOB_ID", by the submit script
LIGHTHOUSE_JOB_VAR = "JAXDIST_LIGHTHOUSE_JOB"
# Kubernetes ports: the lighthouse's (torchft's usual one) and each group's store, on pod 0.
LIGHTHOUSE_PORT = 29510
STORE_PORT = 29600
ATTEMPT = "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"


class Plan(NamedTuple):
    """One group's train arguments and the fleet's settings, checked."""

    args: list[str]  # one group's: --mesh without replica, its share of the batch, no run dir
    run_dir: str
    settings: Settings  # with placeholders where a cluster fills the value in at run time


def plan(fc: FleetConfig, train_args: list[str], find_python: Callable[[], str]) -> Plan:
    """The local launcher's checks (groups, mesh, sync flags, batch, run directory), each a
    one-line ConfigError naming the fix, in its order: the train command's first, then the
    sidecar interpreter on the nodes (`find_python`'s)."""
    if fc.groups < 1:
        raise ConfigError(f"--groups {fc.groups} must be at least 1")
    args, sync, batch_size, run_dir = group_args(train_args, fc.groups)
    python = find_python()
    settings = Settings(
        group=0, groups=fc.groups, run_dir=run_dir, batch_size=batch_size,
        sync=dataclasses.asdict(sync), lighthouse=fc.lighthouse or "", host="", store_port=0,
        ft_python=python, min_groups=fc.min_groups or fc.groups // 2 + 1,
        timeout=fc.collective_timeout,
    )  # fmt: skip
    return Plan(args, run_dir, settings)


def _check_restarts(max_restarts: int) -> None:
    if max_restarts < 0:
        raise ConfigError(
            f"--max-restarts {max_restarts} is negative; pass 0 (no restarts) or more"
        )


def _lighthouse_args(fc: FleetConfig, min_groups: int) -> list[str]:
    """jaxdist/groups/lighthouse.py's arguments after --bind, as the local launcher gives them."""
    return [
        "--min-groups", str(min_groups),
        "--join-timeout-ms", str(int(fc.join_timeout * 1000)),
        "--heartbeat-timeout-ms", str(int(fc.heartbeat_timeout * 1000)),
    ]  # fmt: skip


# ---- Slurm ------------------------------------------------------------------------------------

# Shell functions both Slurm scripts use.
_SLURM_FUNCS = r"""# This node's address, for the torchft sockets to bind and tell the other
# nodes: its first address, not its hostname (which may resolve to a loopback address other
# nodes cannot reach).
node_address() {
  local a
  a=$(hostname -I 2>/dev/null) || true
  a=${a%% *}
  echo "${a:-$(hostname)}"
}

# A port free on this node now.
free_port() {
  python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# The jaxdist package's directory on this node (found without importing it).
jaxdist_dir() {
  python -c 'import importlib.util as u
print(u.find_spec("jaxdist").submodule_search_locations[0])'
}"""

# The lighthouse job's end: started, started again on the same address when it dies, stopped
# once the groups' array has left the queue.
_LIGHTHOUSE_SH = r"""# The groups' job array, once the submit script has named it (with this
# job's id: a file left by an earlier fleet names another lighthouse); returns 1 once the
# array has left the queue.
groups_left() {
  local file="$RUN_DIR/GROUPS_FILE" ours array out
  [[ -s $file ]] && read -r ours array <"$file" && [[ $ours == "$SLURM_JOB_ID" ]] || return 0
  if out=$(squeue -h -j "$array" -o %i 2>&1); then
    [[ -n $out ]]
    return
  fi
  # Purged from slurmctld's records: gone. Any other error (slurmctld busy): still there.
  [[ $out != *"Invalid job id"* ]]
}

# A restart's line of RUN_DIR/restarts.jsonl (jaxdist.cluster.restarts): by the lighthouse
record() {
  mkdir -p "$RUN_DIR"
  printf '{"time": %s, "restart": 0, "max_restarts": 0, "cause": "%s", "by": "lighthouse"}\n' \
    "$(date +%s.%N)" "$1" >>"$RUN_DIR/restarts.jsonl"
}

mkdir -p "$RUN_DIR"
# Where the groups find it: written whole (a group never reads half a line).
printf '%s http://%s:%s\n' "$SLURM_JOB_ID" "$FT_HOST" "$PORT" >"$RUN_DIR/LIGHTHOUSE_FILE.tmp"
mv "$RUN_DIR/LIGHTHOUSE_FILE.tmp" "$RUN_DIR/LIGHTHOUSE_FILE"
while true; do
  RUST_LOG=warn "$FT_PYTHON" "$LIGHTHOUSE_PY" --bind "$FT_HOST:$PORT" "${LIGHTHOUSE_ARGS[@]}" &
  pid=$!
  printf '{"group": "lighthouse", "process": 0, "pid": %d, "start": %s}\n' "$pid" \
    "$(date +%s.%N)" >>"$RUN_DIR/launch.jsonl"
  tick=0
  while kill -0 "$pid" 2>/dev/null; do
    if ((tick++ % 10 == 0)) && ! groups_left; then
      echo "jaxdist: the groups' jobs have ended; the lighthouse stops"
      kill "$pid"
      wait "$pid" || true
      exit 0
    fi
    sleep 1
  done
  code=0
  wait "$pid" || code=$?
  echo "jaxdist: the lighthouse exited ($code); starting it again on $FT_HOST:$PORT" >&2
  record "lighthouse exited with code $code"
done"""

# A group's address of the lighthouse, read again before each attempt: a lighthouse requeued
# after its node's loss comes back elsewhere, under the same job id.
_FIND_LIGHTHOUSE_SH = r"""# The lighthouse's address, from the file its job writes: the one of job
# $JAXDIST_LIGHTHOUSE_JOB where the submit script named it (a file left by an earlier fleet
# names another job).
find_lighthouse() {
  local file="$RUN_DIR/LIGHTHOUSE_FILE" job address i
  for ((i = 0; i < 600; i++)); do
    if [[ -s $file ]] && read -r job address <"$file" \
      && [[ -z ${JAXDIST_LIGHTHOUSE_JOB:-} || $job == "$JAXDIST_LIGHTHOUSE_JOB" ]]; then
      LIGHTHOUSE=$address
      return 0
    fi
    sleep 1
  done
  echo "jaxdist: group $GROUP: no lighthouse address in $file after 600 s; is the lighthouse's" \
    "job (${JAXDIST_LIGHTHOUSE_JOB:-see the submit script}) running? squeue -u $USER" >&2
  return 1
}"""


def _settings_sh(settings: Settings) -> str:
    """JAXDIST_GROUP's value as a shell word: the settings' JSON, with the values only a node
    knows at run time (group, addresses, store port, heal) taken from shell variables."""
    fields = dataclasses.asdict(settings)
    fields.update(group="@GROUP@", host="@FT_HOST@", store_port="@STORE_PORT@", heal="@HEAL@")
    if not settings.lighthouse:
        fields["lighthouse"] = "@LIGHTHOUSE@"
    text = json.dumps(fields)
    for number in ("GROUP", "STORE_PORT", "HEAL"):  # bare in the JSON: a number, a bool
        text = text.replace(f'"@{number}@"', f"@{number}@")
    parts = re.split(r"@([A-Z_]+)@", text)
    return "".join(
        f'"${{{p}}}"' if i % 2 else shlex.quote(p) for i, p in enumerate(parts) if p or i % 2
    )


def _gloo_sh() -> list[str]:
    return [
        "# Gloo (torchft's all-reduce between the groups) on the interface of FT_HOST: by the",
        "# hostname it may pick loopback. The group's other nodes use the same name for theirs.",
        "if [[ -z ${GLOO_SOCKET_IFNAME:-} ]] && command -v ip >/dev/null; then",
        "  GLOO_SOCKET_IFNAME=$(ip -o addr show to \"$FT_HOST\" | awk '{print $2; exit}')",
        "  [[ -z $GLOO_SOCKET_IFNAME ]] || export GLOO_SOCKET_IFNAME",
        "fi",
    ]


def _head(job_name: str, time_limit: str, env: str | None, extra: list[str]) -> list[str]:
    return [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        *extra,
        f"#SBATCH --time={time_limit}",
        "#SBATCH --requeue",
        *manifests.activation(env),
        "set -euo pipefail",
        "",
    ]


def slurm_lighthouse(
    fc: FleetConfig, p: Plan, job_name: str, time_limit: str, env: str | None = None
) -> str:
    """The lighthouse's sbatch script: one task, started again on its address when it dies.

    A job of its own rather than a step of a group's allocation: a group's allocation ends
    with that group (a node lost, a requeue, its last restart spent), and the lighthouse must
    outlive any one group. Not a heterogeneous job's component either: Slurm requeues and
    cancels a heterogeneous job whole, so a group's requeue would take the lighthouse with
    it, and a job array cannot be heterogeneous. It stops once the groups' array has left the
    queue; `--requeue` brings it back after its node's loss (on a new address, which each
    group reads again before its next attempt)."""
    host = shlex.quote(fc.host) if fc.host else "$(node_address)"
    extra = ["#SBATCH --ntasks=1", "#SBATCH --output=%x-%j.out"]
    lines = _head(f"{job_name}-lighthouse", time_limit, env, extra)
    lines += [
        f"RUN_DIR={shlex.quote(p.run_dir)}",
        f"FT_PYTHON={shlex.quote(p.settings.ft_python)}",
        _SLURM_FUNCS,
        f"FT_HOST={host}",
        "PORT=$(free_port)",
        'LIGHTHOUSE_PY="$(jaxdist_dir)/groups/lighthouse.py"',
        "LIGHTHOUSE_ARGS=(" + " ".join(_lighthouse_args(fc, p.settings.min_groups)) + ")",
        "",
        _LIGHTHOUSE_SH.replace("GROUPS_FILE", GROUPS_FILE).replace(
            "LIGHTHOUSE_FILE", LIGHTHOUSE_FILE
        ),
    ]
    return "\n".join(lines) + "\n"


def slurm_groups(
    fc: FleetConfig, p: Plan, nodes: int, gpus_per_node: int, job_name: str, time_limit: str,
    max_restarts: int, env: str | None = None, cpu_devices_per_task: int = 4,
) -> str:  # fmt: skip
    """The groups' sbatch script: a job array of M elements, element G group G, each its own
    `jax.distributed` job over its `nodes` nodes (JAX's Slurm detection, as the single job's),
    restarted alone in its allocation up to `max_restarts` times by the single job's loop,
    each restart a line of RUN_DIR/restarts.jsonl by "group G" (as the local launcher's).
    A restarted group, or one requeued after its node's loss, heals from a live peer."""
    tasks = gpus_per_node or 1
    extra = [
        f"#SBATCH --array=0-{fc.groups - 1}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
    ]
    if gpus_per_node:
        extra.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    extra += ["#SBATCH --signal=TERM@120", "#SBATCH --output=%x-%A_%a.out"]
    args = list(p.args)
    if not gpus_per_node and "--devices" not in args:
        args += ["--devices", f"cpu:{cpu_devices_per_task}"]
    cmd = manifests._command(args) + ' --run-dir "$RUN_DIR/groups/$GROUP"'
    # The store binds the batch host, task 0's node: the group's other nodes connect to it.
    host = shlex.quote(fc.host) if fc.host else "$(node_address)"
    find = _FIND_LIGHTHOUSE_SH.replace("LIGHTHOUSE_FILE", LIGHTHOUSE_FILE)
    lines = _head(job_name, time_limit, env, extra) + [
        "GROUP=$SLURM_ARRAY_TASK_ID",
        f"RUN_DIR={shlex.quote(p.run_dir)}",
        f"MAX_RESTARTS={max_restarts}",
        _SLURM_FUNCS,
        f"FT_HOST={host}",
        *_gloo_sh(),
        "# A group requeued after its node's loss joins a running fleet: it heals, as a",
        "# restart in the allocation does.",
        "HEAL=false",
        "((${SLURM_RESTART_COUNT:-0} == 0)) || HEAL=true",
        "",
        *([] if fc.lighthouse else [find, ""]),
        "# One attempt of the group: its settings (a fresh store port; the lighthouse's address",
        "# again), a line of RUN_DIR/launch.jsonl, one srun; srun's lines about failed tasks go",
        "# into REPORT, its stderr on to the script's (as the single job's loop).",
        "attempt() {",
        "  local rc",
        "  STORE_PORT=$(free_port)",
        *([] if fc.lighthouse else ["  find_lighthouse || exit 1"]),
        f"  export {ENV}={_settings_sh(p.settings)}",
        '  mkdir -p "$RUN_DIR"',
        '  printf \'{"group": %d, "process": 0, "pid": %d, "start": %s}\\n\' "$GROUP" "$$" \\',
        '    "$(date +%s.%N)" >>"$RUN_DIR/launch.jsonl"',
        f"  srun --kill-on-bad-exit=1 {cmd} 2>&1 >&3 \\",
        '    | tee >(cat >&2) | grep --line-buffered -E "$TASK_LINE" >"$REPORT"',
        "  rc=${PIPESTATUS[0]}",
        "  HEAL=true  # a later attempt rejoins the fleet running without it",
        '  return "$rc"',
        "}",
        "",
        _group_restart_sh(),
    ]
    return "\n".join(lines) + "\n"


def _group_restart_sh() -> str:
    """The single job's restart loop, its records by "group G" (the fleet's accounting,
    jaxdist.groups.accounting, reads a group's restarts by that name)."""
    by = '"by": "slurm"'
    assert manifests._RESTART_SH.count(by) == 1, "the restart loop's record changed"
    return manifests._RESTART_SH.replace(by, '"by": "group \'"$GROUP"\'"')


def slurm_fleet(
    fc: FleetConfig, nodes: int, gpus_per_node: int, train_args: list[str],
    job_name: str = "jaxdist", time_limit: str = "24:00:00", max_restarts: int = 0,
    env: str | None = None,
) -> str:  # fmt: skip
    """The submit script (`bash THIS_FILE`): the lighthouse's job (unless --lighthouse names a
    running one), then the groups' array, which starts once the lighthouse has
    (--dependency=after), both scripts held in the file."""
    _check_restarts(max_restarts)
    p = plan(fc, train_args, lambda: ft_python(fc.ft_python))
    groups = slurm_groups(fc, p, nodes, gpus_per_node, job_name, time_limit, max_restarts, env)
    run_dir = shlex.quote(p.run_dir)
    lines = [
        "#!/bin/bash",
        f"# jaxdist: a lighthouse and {fc.groups} replica groups of {nodes} node(s) each.",
        "# Submit from the directory the run's relative paths start in: bash THIS_FILE",
        "set -euo pipefail",
        f"RUN_DIR={run_dir}",
        'mkdir -p "$RUN_DIR"',
        "# An earlier fleet's array, gone: the new lighthouse would stop at once.",
        f'rm -f "$RUN_DIR/{GROUPS_FILE}"',
    ]
    if fc.lighthouse:
        lines += [
            "GROUPS_JOB=$(sbatch --parsable <<'JAXDIST_GROUPS'",
            f"{groups}JAXDIST_GROUPS",
            ")",
            'echo "jaxdist: groups: job array ${GROUPS_JOB%%;*}"',
        ]
        return "\n".join(lines) + "\n"
    lighthouse = slurm_lighthouse(fc, p, job_name, time_limit, env)
    lines += [
        "LIGHTHOUSE_JOB=$(sbatch --parsable <<'JAXDIST_LIGHTHOUSE'",
        f"{lighthouse}JAXDIST_LIGHTHOUSE",
        ")",
        "LIGHTHOUSE_JOB=${LIGHTHOUSE_JOB%%;*}",
        "GROUPS_JOB=$(sbatch --parsable --dependency=after:$LIGHTHOUSE_JOB \\",
        f"  --export=ALL,{LIGHTHOUSE_JOB_VAR}=$LIGHTHOUSE_JOB <<'JAXDIST_GROUPS'",
        f"{groups}JAXDIST_GROUPS",
        ")",
        "GROUPS_JOB=${GROUPS_JOB%%;*}",
        "# The lighthouse stops once this array has left the queue.",
        f'echo "$LIGHTHOUSE_JOB $GROUPS_JOB" >"$RUN_DIR/{GROUPS_FILE}"',
        'echo "jaxdist: lighthouse: job $LIGHTHOUSE_JOB; groups: job array $GROUPS_JOB"',
    ]
    return "\n".join(lines) + "\n"


# ---- Kubernetes -------------------------------------------------------------------------------

# A group's pod: the settings of a healing group after its JobSet's first restart (the group
# lost, its pods created again while the others run on).
_HEAL_SH = (
    f'if [ "${{JOBSET_RESTART_ATTEMPT:-0}}" != 0 ]; then export {ENV}="${ENV}_HEAL"; fi; exec "$@"'
)
# The lighthouse's pod: lighthouse.py from the image's jaxdist, run by the sidecar interpreter.
_LIGHTHOUSE_POD_SH = (
    'py=$1; shift; exec "$py" "$(python -c \'import importlib.util as u; '
    'print(u.find_spec("jaxdist").submodule_search_locations[0])\')/groups/lighthouse.py" "$@"'
)


def k8s_fleet(
    fc: FleetConfig, hosts: int, train_args: list[str], image: str, run_volume: str,
    gpus_per_host: int = 8, name: str = "jaxdist", run_mount: str = manifests.RUN_MOUNT,
    max_restarts: int = 3, port: int = 1234,
) -> str:  # fmt: skip
    """The lighthouse's Service and Deployment (Kubernetes restarts its pod on the Service's
    address), then a JobSet per group, NAME-gG, of `hosts` indexed pods: a jax.distributed
    job whose pod 0 coordinates and holds the group's torchft store. A lost pod fails its
    group's JobSet alone, restarted up to `max_restarts` times; its pods heal from a live
    peer. The run directory is on the claim, as the single JobSet's."""
    _check_restarts(max_restarts)
    manifests.check_k8s(image, run_volume)
    p = plan(fc, train_args, lambda: _image_python(fc.ft_python))
    python = p.settings.ft_python
    manifests._on_volume(["--run-dir", p.run_dir], posixpath.normpath(run_mount), name)
    address = fc.lighthouse or f"http://{name}-lighthouse:{LIGHTHOUSE_PORT}"
    docs = [] if fc.lighthouse else _lighthouse_docs(fc, p, image, f"{name}-lighthouse")
    for g in range(fc.groups):
        job = f"{name}-g{g}"
        s = dataclasses.replace(
            p.settings, group=g, lighthouse=address, host=f"{job}-workers-0-0.{job}",
            store_port=STORE_PORT,
        )  # fmt: skip
        args = [
            *p.args, "--run-dir", f"{p.run_dir}/groups/{g}", "--coordinator", f"{s.host}:{port}",
            "--num-processes", str(hosts), "--process-id", "$(JOB_COMPLETION_INDEX)",
        ]  # fmt: skip
        pod = manifests._pod(image, args, port, gpus_per_host, run_volume, run_mount)
        (c,) = pod["containers"]
        c["command"], c["args"] = ["/bin/sh", "-c", _HEAL_SH, "jaxdist"], [*c["command"], *args]
        c["ports"].append({"containerPort": STORE_PORT})
        c["env"] += [
            {"name": "JOBSET_RESTART_ATTEMPT", "valueFrom": {"fieldRef": {"fieldPath": ATTEMPT}}},
            {"name": ENV, "value": s.to_env()},
            {"name": f"{ENV}_HEAL", "value": dataclasses.replace(s, heal=True).to_env()},
        ]  # fmt: skip
        docs.append(manifests.jobset_doc(job, hosts, pod, max_restarts))
    header = (
        f"# jaxdist: a lighthouse and {fc.groups} replica groups of {hosts} pod(s) each: "
        "kubectl apply -f THIS_FILE\n"
        f"# image: {manifests.BUILD_IMAGE.replace('IMAGE', image)}, with the torchft sidecar's "
        f"interpreter at {python} (a Python 3.11 with {FT_PACKAGES}; the Dockerfile has none)\n"
        f"# the claim {run_volume} (ReadWriteMany) must exist: the run directory is on it\n"
    )
    return header + yaml.safe_dump_all(docs, sort_keys=False)


def _image_python(given: str | None) -> str:
    """The sidecar interpreter's path in the image: not checked here, where the image is not."""
    python = given or os.environ.get(FT_PYTHON_VAR)
    if not python:
        raise ConfigError(
            "--groups runs torchft in a sidecar interpreter inside the image: name it with "
            f"--ft-python PATH (a Python 3.11 there with {FT_PACKAGES}) or {FT_PYTHON_VAR}"
        )
    return python


def _lighthouse_docs(fc: FleetConfig, p: Plan, image: str, name: str) -> list[dict]:
    """The lighthouse's Service (the address the groups are given) and its Deployment: one
    pod, never two at once (Recreate: two lighthouses would split the quorum)."""
    labels = {"app": name}  # copied where used: one dict twice would be a YAML alias
    container = {
        "name": "lighthouse",
        "image": image,
        "command": ["/bin/sh", "-c", _LIGHTHOUSE_POD_SH, "lighthouse"],
        "args": [
            p.settings.ft_python,
            "--bind",
            f"0.0.0.0:{LIGHTHOUSE_PORT}",
            *_lighthouse_args(fc, p.settings.min_groups),
        ],
        "env": [{"name": "RUST_LOG", "value": "warn"}],
        "ports": [{"containerPort": LIGHTHOUSE_PORT}],
        "readinessProbe": {"tcpSocket": {"port": LIGHTHOUSE_PORT}, "periodSeconds": 2},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": dict(labels), "ports": [{"port": LIGHTHOUSE_PORT}]},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": dict(labels)},
            "template": {"metadata": {"labels": dict(labels)}, "spec": {"containers": [container]}},
        },
    }
    return [service, deployment]
