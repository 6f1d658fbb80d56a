"""A fleet of replica groups on Slurm (`jaxdist slurm --groups M`): what `jaxdist launch --groups
M` does on one host (jaxdist.groups.fleet), in Slurm's terms. A submit script queues the torchft
lighthouse as a small job of its own and the groups as one job array of M elements, each element
a group (its own `jax.distributed` job, its restarts the single job's loop, jaxdist.cluster.
manifests). A group's processes learn who they are from JAXDIST_GROUP (jaxdist.groups.member.
Settings, as JSON): its id, the lighthouse's address, the address its torchft store binds, the
sidecar's interpreter. The checks are the local launcher's (jaxdist.groups.fleet.plan).
"""

import dataclasses
import json
import re
import shlex

from jaxdist.cluster import manifests
from jaxdist.groups.bridge import ft_python
from jaxdist.groups.fleet import FleetConfig, Plan, check_restarts, lighthouse_args, plan
from jaxdist.groups.member import ENV, Settings

# Files in the fleet's run directory through which the Slurm jobs find each other.
LIGHTHOUSE_FILE = "lighthouse.slurm"  # "LIGHTHOUSE_JOB_ID http://HOST:PORT", by the lighthouse
GROUPS_FILE = "groups.slurm"  # "LIGHTHOUSE_JOB_ID GROUPS_JOB_ID", by the submit script
LIGHTHOUSE_JOB_VAR = "JAXDIST_LIGHTHOUSE_JOB"

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
        "LIGHTHOUSE_ARGS=(" + " ".join(lighthouse_args(fc, p.settings.min_groups)) + ")",
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
    check_restarts(max_restarts)
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
