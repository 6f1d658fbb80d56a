"""Training under a real Slurm: srun starts 2 tasks, JAX's Slurm detection joins them, and
the losses match one process on the same mesh; the sbatch script's restart loop brings a run
with a killed task back in the same allocation, to the same losses."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from jaxdist.cli.main import main
from jaxdist.cluster.launch import free_port
from jaxdist.groups.bridge import HERE
from jaxdist.metrics.goodput import read_restarts
from tests.extras import FT_PYTHON_VAR, needs_ft
from tests.helpers import JAXDIST, cli, losses, tiny_train
from tests.slurm_cluster import SlurmCluster, why_not

REASON = why_not()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    pytest.mark.slow,  # starts Slurm daemons, then trains twice
]
TRAIN = tiny_train(6, checkpoint_every=100)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """TRAIN's losses in one process of 8 devices, once for both runs it is the reference of
    (the sbatch run's checkpoints every 2 steps change nothing a run computes)."""
    ref = tmp_path_factory.mktemp("ref")
    # In this process (the CLI's own main): one process is what the Slurm runs are checked
    # against, not what they are about; no interpreter to start.
    assert main([*TRAIN, "--devices", "cpu:8", "--run-dir", str(ref)]) == 0
    return losses(ref)


def test_srun_two_tasks_train_like_one_process(cluster, reference, tmp_path):
    run_dir = tmp_path / "slurm"
    r = cluster.run(
        [
            "timeout",
            "400",
            "srun",
            "-N1",
            "-n2",
            "--kill-on-bad-exit=1",
            *JAXDIST,
            *TRAIN,
            "--devices",
            "cpu:4",
            "--run-dir",
            str(run_dir),
        ],
        timeout=450,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["devices"]["processes"] == 2 and config["devices"]["count"] == 8
    got = losses(run_dir)
    assert list(got) == list(reference) == list(range(6))
    np.testing.assert_allclose(list(got.values()), list(reference.values()), rtol=1e-5)


def test_sbatch_accepts_the_rendered_script(cluster, tmp_path):
    rendered = cli("slurm", "--nodes", "1", "--gpus-per-node", "0", "--", *TRAIN, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    script = rendered.stdout
    path = tmp_path / "job.sh"
    path.write_text(script)
    r = cluster.run(["sbatch", "--test-only", str(path)], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "to start at" in r.stderr


def test_sbatch_restarts_a_killed_task_in_the_allocation(cluster, reference, tmp_path):
    train = [*tiny_train(6, checkpoint_every=2), "--devices", "cpu:4"]
    rendered = cli(
        "slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "0",
        "--max-restarts",
        "2",
        "--",
        *train,
        "--fault",
        "kill:3:1",  # SIGKILL to process 1 before step 3, once: the rerun replays from a save
        timeout=60,
    )
    assert rendered.returncode == 0, rendered.stderr
    (tmp_path / "job.sh").write_text(rendered.stdout)
    # Two tasks on the one node (the script asks one per node when there are no GPUs); the
    # job's `python` is this one.
    r = cluster.run(
        ["sbatch", "--wait", "--parsable", "--ntasks-per-node=2", "job.sh"],
        cwd=tmp_path,
        timeout=900,
        env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]},
    )
    job_id = r.stdout.strip()
    log = next(tmp_path.glob("jaxdist-*.out")).read_text()
    assert r.returncode == 0, r.stderr + log[-5000:]
    run_dir = tmp_path / "runs" / f"jaxdist-{job_id}"  # the script's default: JOB_NAME-JOB_ID
    (rec,) = read_restarts(run_dir)
    assert rec["restart"] == 1 and rec["max_restarts"] == 2 and rec["by"] == "slurm"
    # srun's own code is the stopped task's; the cause names the task that was killed.
    assert re.fullmatch(r"srun exited \d+ \(task 1 killed by SIGKILL\)", rec["cause"]), rec
    assert f"jaxdist: attempt 1: {rec['cause']}; restart 1 of 2" in log
    config = json.loads((run_dir / "config.json").read_text())
    assert config["devices"]["processes"] == 2 and config["devices"]["count"] == 8
    got = losses(run_dir)
    assert list(got) == list(reference) == list(range(6))
    np.testing.assert_allclose(list(got.values()), list(reference.values()), rtol=1e-5)


def test_sbatch_accepts_the_fleet_scripts(cluster, tmp_path):
    """`jaxdist slurm --groups 2`'s two scripts (the lighthouse's job, the groups' array), as
    sbatch would queue them (the next test runs the array, with -m experiment)."""
    from jaxdist.groups import fleet, fleet_slurm
    from jaxdist.groups.fleet import FleetConfig

    train = [*TRAIN, "--run-dir", str(tmp_path / "fleet")]
    train[train.index("--mesh") + 1] = "replica=2,data=2"
    fc = FleetConfig(2, sys.executable, "127.0.0.1")
    p = fleet.plan(fc, train, lambda: sys.executable)
    scripts = {
        "lighthouse.sh": fleet_slurm.slurm_lighthouse(fc, p, "jaxdist", "0:10:00"),
        "groups.sh": fleet_slurm.slurm_groups(fc, p, 1, 0, "jaxdist", "0:10:00", 1),
    }
    for name, script in scripts.items():
        (tmp_path / name).write_text(script)
        r = cluster.run(["sbatch", "--test-only", str(tmp_path / name)], timeout=60)
        assert r.returncode == 0, name + ": " + r.stderr
        assert "to start at" in r.stderr


# 42 s measured on two shared cores, over the suite's share for one test: -m experiment.
@pytest.mark.experiment
@needs_ft
def test_a_fleet_of_two_groups_runs_as_a_job_array(cluster, tmp_path):
    """`jaxdist slurm --groups 2`'s array, queued by sbatch: two groups of one task each, on
    the one node, meet the lighthouse every 4 steps and both take part in every round. The
    lighthouse runs beside the cluster (--lighthouse), not as its job: three one-CPU jobs do
    not fit a two-core node at once; its script's loop is tests/test_fleet_files.py's."""
    ft = os.environ[FT_PYTHON_VAR]
    port = free_port()
    lighthouse = subprocess.Popen(
        [ft, str(HERE / "lighthouse.py"), "--bind", f"127.0.0.1:{port}", "--min-groups", "2"],
        env={**os.environ, "RUST_LOG": "warn"}, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    run_dir = tmp_path / "fleet"
    train = [*tiny_train(8, checkpoint_every=1000), "--run-dir", str(run_dir)]
    train[train.index("--mesh") + 1] = "replica=2,data=2"
    try:
        rendered = cli(
            "slurm", "--groups", "2", "--gpus-per-node", "0", "--ft-python", ft, "--ft-host",
            "127.0.0.1", "--lighthouse", f"http://127.0.0.1:{port}", "--time", "0:10:00", "--",
            *train, "--devices", "cpu:2", "--sync-every", "4", timeout=60,
        )  # fmt: skip
        assert rendered.returncode == 0, rendered.stderr
        script = rendered.stdout.split("<<'JAXDIST_GROUPS'\n")[1].split("JAXDIST_GROUPS\n")[0]
        (tmp_path / "groups.sh").write_text(script)
        r = cluster.run(
            ["sbatch", "--wait", "--parsable", "groups.sh"], cwd=tmp_path, timeout=300,
            env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]},
        )  # fmt: skip
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=10)
    logs = "".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("jaxdist-*.out")))
    assert r.returncode == 0, r.stderr + logs
    rounds = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rounds] == [3, 7] and all(x["groups"] == [0, 1] for x in rounds)
    launches = [json.loads(x) for x in (run_dir / "launch.jsonl").read_text().splitlines()]
    assert sorted(x["group"] for x in launches) == [0, 1]
    for g in (0, 1):
        assert list(losses(run_dir / "groups" / str(g))) == list(range(8))
