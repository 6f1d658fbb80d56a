"""A fleet's launch files (`jaxdist slurm|k8s --groups M`: jaxdist.groups.fleet_slurm and
fleet_k8s), with no cluster: the Slurm scripts parsed by bash and run by it against a fake
sbatch, srun, squeue and lighthouse on PATH; the Kubernetes manifests parsed by PyYAML and read
by structure. tests/test_slurm.py gives the same scripts to a real sbatch."""

import dataclasses
import json
import os
import re
import stat
import subprocess
import sys

import pytest
import yaml

from jaxdist.cli.main import main
from jaxdist.groups import fleet, fleet_k8s, fleet_slurm
from jaxdist.groups.fleet import FleetConfig
from jaxdist.metrics.goodput import read_restarts

# The sidecar's path is only written into the files, never run: any file will do.
FT = sys.executable
TRAIN = [
    "train", "--model", "tiny", "--mesh", "replica=3,data=2", "--sync-every", "4",
    "--batch-size", "12", "--steps", "8",
]  # fmt: skip


def _exe(path, text: str) -> None:
    path.write_text("#!/bin/bash\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _bash_n(tmp_path, script: str) -> None:
    path = tmp_path / "check.sh"
    path.write_text(script)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _run(tmp_path, script: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", **env}
    return subprocess.run(
        ["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def _plan(run_dir, **given) -> tuple[FleetConfig, fleet.Plan]:
    fc = FleetConfig(3, FT, **{"host": "127.0.0.1", **given})
    return fc, fleet.plan(fc, [*TRAIN, "--run-dir", str(run_dir)], lambda: FT)


def jaxdist(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_submit_script_queues_the_lighthouse_then_the_groups_array(tmp_path, capsys):
    run_dir = tmp_path / "fleet"
    rc, script, err = jaxdist(
        capsys, "slurm", "--groups", "3", "--nodes", "2", "--gpus-per-node", "8",
        "--max-restarts", "2", "--ft-python", FT, "--", *TRAIN, "--run-dir", str(run_dir),
    )  # fmt: skip
    assert rc == 0, err
    _bash_n(tmp_path, script)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # Each call: its arguments a line of CALLS, its script (stdin) a file; job ids 101, 102.
    _exe(
        bindir / "sbatch",
        'echo "$*" >>"$CALLS"; n=$(wc -l <"$CALLS"); cat >"script$n.sh"; echo "$((100 + n));c"\n',
    )
    (run_dir).mkdir()
    (run_dir / fleet_slurm.GROUPS_FILE).write_text("5 6\n")  # an earlier fleet's
    r = _run(tmp_path, script, {"CALLS": str(tmp_path / "calls")})
    assert r.returncode == 0, r.stderr
    lighthouse, groups = (tmp_path / "calls").read_text().splitlines()
    assert lighthouse == "--parsable"
    # The groups start once the lighthouse has, and know its job (its address file's key).
    assert groups == "--parsable --dependency=after:101 --export=ALL,JAXDIST_LIGHTHOUSE_JOB=101"
    assert (run_dir / fleet_slurm.GROUPS_FILE).read_text() == "101 102\n"
    assert "lighthouse: job 101; groups: job array 102" in r.stdout
    lh, gr = ((tmp_path / f"script{n}.sh").read_text() for n in (1, 2))
    for part in (lh, gr):
        _bash_n(tmp_path, part)
    assert "#SBATCH --ntasks=1" in lh and "--array" not in lh
    for want in (
        "#SBATCH --array=0-2", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8", "#SBATCH --requeue", "MAX_RESTARTS=2",
    ):  # fmt: skip
        assert want in gr.splitlines(), want
    (srun,) = [x.strip() for x in gr.splitlines() if x.strip().startswith("srun ")]
    # Every group: the same per-group mesh and train flags, its share of the batch, its own
    # run directory; JAX's Slurm detection makes each element its own jax.distributed job.
    assert "python -m jaxdist.cli train --model tiny --steps 8 --mesh data=2 --batch-size 4" in srun
    assert "--sync-every" not in srun
    assert srun.endswith('--run-dir "$RUN_DIR/groups/$GROUP" 2>&1 >&3 \\')
    assert "--coordinator" not in srun


def _fake_srun(tmp_path, codes: list[int]) -> None:
    """srun: call k (from 1) saves JAXDIST_GROUP as settings-k.json and exits codes[k-1]."""
    arms = "".join(f"  {k}) exit {c} ;;\n" for k, c in enumerate(codes, start=1))
    _exe(
        tmp_path / "bin" / "srun",
        'echo "$*" >>"$CALLS"; n=$(wc -l <"$CALLS")\n'
        'printf %s "$JAXDIST_GROUP" >"settings-$n.json"\n'
        'case $n in\n' + arms + "esac\n",
    )  # fmt: skip


def test_a_group_is_told_its_id_and_the_lighthouse_and_restarts_alone(tmp_path):
    run_dir = tmp_path / "fleet"
    fc, p = _plan(run_dir)
    script = fleet_slurm.slurm_groups(fc, p, 1, 0, "job", "1:00:00", max_restarts=2)
    (tmp_path / "bin").mkdir()
    _fake_srun(tmp_path, [137, 0])
    run_dir.mkdir()
    # An earlier fleet's lighthouse (job 5), then this one's (job 9): the group takes job 9's.
    (run_dir / fleet_slurm.LIGHTHOUSE_FILE).write_text("5 http://10.0.0.5:1\n")
    env = {"CALLS": str(tmp_path / "calls"), "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "77"}
    env[fleet_slurm.LIGHTHOUSE_JOB_VAR] = "9"
    line = f"echo '9 http://10.0.0.9:29510' >{run_dir / fleet_slurm.LIGHTHOUSE_FILE}"
    writer = subprocess.Popen(["bash", "-c", f"sleep 2; {line}"])
    r = _run(tmp_path, script, env)
    writer.wait()
    assert r.returncode == 0, r.stderr
    first, second = (json.loads((tmp_path / f"settings-{n}.json").read_text()) for n in (1, 2))
    assert first["group"] == second["group"] == 1 and first["groups"] == 3
    assert first["lighthouse"] == "http://10.0.0.9:29510"
    assert first["host"] == "127.0.0.1" and first["ft_python"] == FT
    assert first["run_dir"] == str(run_dir) and first["batch_size"] == 12
    assert first["sync"]["sync_every"] == 4 and first["min_groups"] == 2
    assert isinstance(first["store_port"], int) and first["store_port"] > 0
    # Restarted alone, it heals from a live peer; its first attempt joins the fleet's start.
    assert first["heal"] is False and second["heal"] is True
    for call in (tmp_path / "calls").read_text().splitlines():
        assert call.endswith(f"--devices cpu:4 --run-dir {run_dir}/groups/1")
    (rec,) = read_restarts(run_dir)
    assert rec["by"] == "group 1" and rec["restart"] == 1 and rec["max_restarts"] == 2
    assert rec["cause"] == "srun exited 137 (a task killed by SIGKILL)"
    launches = [json.loads(x) for x in (run_dir / "launch.jsonl").read_text().splitlines()]
    assert [x["group"] for x in launches] == [1, 1]


def test_a_requeued_group_heals_and_a_given_lighthouse_is_used_as_is(tmp_path):
    run_dir = tmp_path / "fleet"
    fc, p = _plan(run_dir, lighthouse="http://lh.example:29510")
    script = fleet_slurm.slurm_groups(fc, p, 1, 0, "job", "1:00:00", max_restarts=0)
    assert "find_lighthouse" not in script
    (tmp_path / "bin").mkdir()
    _fake_srun(tmp_path, [0])
    # No run directory yet: the group makes it (for launch.jsonl, before its first process).
    env = {"CALLS": str(tmp_path / "calls"), "SLURM_ARRAY_TASK_ID": "0", "SLURM_RESTART_COUNT": "1"}
    r = _run(tmp_path, script, env)
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "settings-1.json").read_text())
    assert [json.loads(x)["group"] for x in (run_dir / "launch.jsonl").open()] == [0]
    assert s["lighthouse"] == "http://lh.example:29510" and s["group"] == 0 and s["heal"] is True


def test_the_lighthouse_restarts_on_its_address_and_stops_with_the_groups(tmp_path):
    run_dir = tmp_path / "fleet"
    fc, p = _plan(run_dir, heartbeat_timeout=2.5)
    fake_python = tmp_path / "ftpython"
    # Its first lighthouse dies at once (exit 3); the second runs until it is killed.
    # (exec: a killed lighthouse leaves no child holding the job's output open)
    fake = 'echo "$*" >>"$LH_CALLS"\n(($(wc -l <"$LH_CALLS") > 1)) || exit 3\nexec sleep 60\n'
    _exe(fake_python, fake)
    p = p._replace(settings=dataclasses.replace(p.settings, ft_python=str(fake_python)))
    script = fleet_slurm.slurm_lighthouse(fc, p, "job", "1:00:00")
    (tmp_path / "bin").mkdir()
    # The groups' array (88) is in the queue until the second lighthouse has started.
    _exe(tmp_path / "bin" / "squeue", '(( $(wc -l <"$LH_CALLS") > 1 )) || echo 88_0\n')
    run_dir.mkdir()
    (run_dir / fleet_slurm.GROUPS_FILE).write_text("77 88\n")
    env = {"LH_CALLS": str(tmp_path / "lh"), "SLURM_JOB_ID": "77"}
    r = _run(tmp_path, script, env)
    assert r.returncode == 0, r.stderr
    assert "the groups' jobs have ended; the lighthouse stops" in r.stdout
    job, address = (run_dir / fleet_slurm.LIGHTHOUSE_FILE).read_text().split()
    assert job == "77" and re.fullmatch(r"http://127\.0\.0\.1:\d+", address)
    calls = (tmp_path / "lh").read_text().splitlines()
    assert len(calls) == 2 and calls[0] == calls[1]  # the same address, the same settings
    assert calls[0].split()[0].endswith("groups/lighthouse.py")
    assert f"--bind 127.0.0.1:{address.rpartition(':')[2]} --min-groups 2" in calls[0]
    assert "--heartbeat-timeout-ms 2500" in calls[0]
    (rec,) = read_restarts(run_dir)
    assert rec["by"] == "lighthouse" and rec["cause"] == "lighthouse exited with code 3"


def test_kubernetes_a_lighthouse_and_a_jobset_per_group(tmp_path, capsys):
    rc, out, err = jaxdist(
        capsys, "k8s", "--image", "reg.example/j:1", "--run-volume", "runs", "--groups", "3",
        "--hosts", "2", "--max-restarts", "5", "--ft-python", "/opt/ft/bin/python", "--name",
        "fl", "--", *TRAIN, "--run-dir", "/runs/fl",
    )  # fmt: skip
    assert rc == 0, err
    service, deployment, *sets = yaml.safe_load_all(out)
    assert service["kind"] == "Service" and deployment["kind"] == "Deployment"
    assert service["metadata"]["name"] == deployment["metadata"]["name"] == "fl-lighthouse"
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    (lh,) = deployment["spec"]["template"]["spec"]["containers"]
    assert lh["args"][0] == "/opt/ft/bin/python" and "--min-groups" in lh["args"]
    port = service["spec"]["ports"][0]["port"]
    assert [s["metadata"]["name"] for s in sets] == ["fl-g0", "fl-g1", "fl-g2"]
    for g, s in enumerate(sets):
        assert s["kind"] == "JobSet" and s["spec"]["failurePolicy"]["maxRestarts"] == 5
        (rj,) = s["spec"]["replicatedJobs"]
        job = rj["template"]["spec"]
        assert job["parallelism"] == job["completions"] == 2 and job["backoffLimit"] == 0
        (c,) = job["template"]["spec"]["containers"]
        args = c["args"]
        group_train = [*TRAIN[:3], "--steps", "8", "--mesh", "data=2", "--batch-size", "4"]
        assert args[:12] == ["python", "-m", "jaxdist.cli", *group_train]
        assert args[args.index("--run-dir") + 1] == f"/runs/fl/groups/{g}"
        pod0 = f"fl-g{g}-workers-0-0.fl-g{g}"
        assert args[args.index("--coordinator") + 1].startswith(pod0 + ":")
        env = {e["name"]: e for e in c["env"]}
        settings = json.loads(env["JAXDIST_GROUP"]["value"])
        healing = json.loads(env["JAXDIST_GROUP_HEAL"]["value"])
        assert settings["group"] == g and settings["groups"] == 3
        assert settings["lighthouse"] == f"http://fl-lighthouse:{port}"
        assert settings["host"] == pod0 and settings["ft_python"] == "/opt/ft/bin/python"
        assert settings["run_dir"] == "/runs/fl" and settings["heal"] is False
        assert healing == {**settings, "heal": True}
        attempt = env["JOBSET_RESTART_ATTEMPT"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert "jobset.sigs.k8s.io/restart-attempt" in attempt


@pytest.mark.parametrize("attempt, heal", [("0", False), ("2", True)])
def test_kubernetes_a_restarted_group_heals(attempt, heal):
    show = [sys.executable, "-c", "import os; print(os.environ['JAXDIST_GROUP'])"]
    env = {"JAXDIST_GROUP": '{"heal": false}', "JAXDIST_GROUP_HEAL": '{"heal": true}'}
    r = subprocess.run(
        ["/bin/sh", "-c", fleet_k8s._HEAL_SH, "jaxdist", *show],
        env={**env, "JOBSET_RESTART_ATTEMPT": attempt}, capture_output=True, text=True,
    )  # fmt: skip
    assert json.loads(r.stdout) == {"heal": heal}


@pytest.mark.parametrize(
    "command, train, fix",
    [
        ("slurm", ["--mesh", "data=2", "--run-dir", "r"], "--mesh replica=3,data=2"),
        ("slurm", ["--mesh", "replica=2,data=2", "--run-dir", "r"], "or --groups 2"),
        ("k8s", ["--mesh", "replica=3,data=2"], "give --run-dir DIR"),
        (
            "slurm",
            ["--mesh", "replica=3", "--batch-size", "4", "--run-dir", "r"],
            "--batch-size 4 must divide among 3 groups",
        ),
        (
            "k8s",
            ["--mesh", "replica=3", "--batch-size", "3", "--run-dir", "/runs/a"],
            "--ft-python",
        ),
    ],
)
def test_bad_settings_end_in_one_line(capsys, monkeypatch, command, train, fix):
    monkeypatch.delenv("JAXDIST_FT_PYTHON", raising=False)
    extra = ["--image", "i", "--run-volume", "runs"] if command == "k8s" else ["--ft-python", FT]
    rc, out, err = jaxdist(capsys, command, *extra, "--groups", "3", "--", "train", *train)
    assert rc == 2 and not out
    (line,) = err.splitlines()
    assert line.startswith("jaxdist: error: ") and fix in line


def test_slurm_groups_without_the_sidecar_end_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("JAXDIST_FT_PYTHON", raising=False)
    train = ["train", "--mesh", "replica=2", "--run-dir", "r"]
    rc, out, err = jaxdist(capsys, "slurm", "--groups", "2", "--", *train)
    assert rc == 2 and not out
    (line,) = err.splitlines()
    assert "pip install torch==2.13.0 torchft==0.2.0" in line and "JAXDIST_FT_PYTHON" in line


@pytest.mark.parametrize("command", ["slurm", "k8s"])
def test_the_help_tells_of_groups(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "--groups" in out and "--ft-python" in out and "--max-restarts" in out
