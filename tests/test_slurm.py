"""Training under a real Slurm: srun starts 2 tasks, JAX's Slurm detection joins them, and
the losses match one process on the same mesh."""

import json

import numpy as np
import pytest

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


def test_srun_two_tasks_train_like_one_process(cluster, tmp_path):
    ref = tmp_path / "ref"
    r = cli(*TRAIN, "--devices", "cpu:8", "--run-dir", str(ref), timeout=300)
    assert r.returncode == 0, r.stderr
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
    np.testing.assert_allclose(
        list(losses(run_dir).values()), list(losses(ref).values()), rtol=1e-5
    )


def test_sbatch_accepts_the_rendered_script(cluster, tmp_path):
    rendered = cli("slurm", "--nodes", "1", "--gpus-per-node", "0", "--", *TRAIN, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    script = rendered.stdout
    path = tmp_path / "job.sh"
    path.write_text(script)
    r = cluster.run(["sbatch", "--test-only", str(path)], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "to start at" in r.stderr
