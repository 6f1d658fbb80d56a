"""Launch files for clusters: the sbatch script and the JobSet manifest, checked by structure
(and by sbatch itself where Slurm is installed)."""

import yaml

from tests.helpers import cli

TRAIN = ["train", "--model", "1b", "--mesh", "gpu2x8", "--run-dir", "/shared/runs/a b"]


def jaxdist(*args):
    r = cli(*args, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_sbatch_script():
    script = jaxdist("slurm", "--nodes", "2", "--gpus-per-node", "8", "--", *TRAIN)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=TERM@120",
        "#SBATCH --requeue",
    ):
        assert want in lines, want
    srun = [x for x in lines if x.startswith("srun ")]
    assert len(srun) == 1
    assert "python -m jaxdist.cli train --model 1b --mesh gpu2x8" in srun[0]
    assert "'/shared/runs/a b'" in srun[0]  # quoted for the shell
    assert "--coordinator" not in srun[0]  # JAX's Slurm detection supplies it


def test_sbatch_cpu_tasks_get_fake_devices():
    script = jaxdist("slurm", "--nodes", "2", "--gpus-per-node", "0", "--", "train")
    assert "#SBATCH --ntasks-per-node=1" in script and "--devices cpu:4" in script
    assert "--gpus-per-node" not in script


def test_jobset_manifest():
    doc = yaml.safe_load(jaxdist("k8s", "--hosts", "4", "--", *TRAIN))
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    (rj,) = doc["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    (c,) = job["template"]["spec"]["containers"]
    args = c["args"]
    assert args[:5] == TRAIN[:5]
    coord = args[args.index("--coordinator") + 1]
    assert coord.startswith(f"{doc['metadata']['name']}-{rj['name']}-0-0.")
    assert args[args.index("--num-processes") + 1] == "4"
    assert args[args.index("--process-id") + 1] == "$(JOB_COMPLETION_INDEX)"
    env = {e["name"]: e for e in c["env"]}
    assert (
        "job-completion-index" in env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    )
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert doc["spec"]["network"]["subdomain"] == doc["metadata"]["name"]


def test_launch_refuses_what_it_sets_itself():
    r = cli("launch", "--", "train", "--process-id", "0", timeout=60)
    assert r.returncode == 2 and "launch sets --process-id itself" in r.stderr
    r = cli("launch", "--processes", "2", timeout=60)
    assert r.returncode == 2 and "needs the train command after --" in r.stderr
