"""Launch files for clusters: the sbatch script and the JobSet manifest, checked by structure
(and by sbatch itself where Slurm is installed). The commands only print (or refuse): they run
in this process, main() with its output read by capsys."""

import pathlib
import re

import pytest
import yaml

from jaxdist import cluster
from jaxdist.cli.main import main
from jaxdist.cluster.join import gloo_noise

TRAIN = ["train", "--model", "1b", "--mesh", "gpu2x8", "--run-dir", "/shared/runs/a b"]


def jaxdist(capsys, *args):
    """`jaxdist *args` in this process, which must succeed: its stdout."""
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_sbatch_script(capsys):
    script = jaxdist(capsys, "slurm", "--nodes", "2", "--gpus-per-node", "8", "--", *TRAIN)
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


def test_sbatch_cpu_tasks_get_fake_devices(capsys):
    script = jaxdist(capsys, "slurm", "--nodes", "2", "--gpus-per-node", "0", "--", "train")
    assert "#SBATCH --ntasks-per-node=1" in script and "--devices cpu:4" in script
    assert "--gpus-per-node" not in script
    # Every task needs the same run directory, and a requeue must find it again: without
    # --run-dir the script names one after the job (its id survives a requeue).
    (srun,) = [x for x in script.splitlines() if x.startswith("srun ")]
    assert srun.endswith('--run-dir "runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"')
    given = jaxdist(capsys, "slurm", "--", *TRAIN)
    assert given.count("--run-dir") == 1


K8S = ["k8s", "--image", "reg.example/jaxdist:1", "--run-volume", "runs-claim"]


def k8s(capsys, *args):
    """`jaxdist k8s ...` in this process: (exit code, stdout, stderr)."""
    rc = main([*K8S, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_jobset_manifest(capsys):
    rc, out, err = k8s(capsys, "--hosts", "4", "--run-mount", "/shared/runs", "--", *TRAIN)
    assert rc == 0, err
    assert "docker build -f jaxdist/cluster/Dockerfile -t reg.example/jaxdist:1 ." in out
    doc = yaml.safe_load(out)
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    (rj,) = doc["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "reg.example/jaxdist:1"
    args = c["args"]
    assert args[: len(TRAIN)] == TRAIN  # the run directory given is kept: it is on the volume
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
    # The run directory lives on the claim, mounted where --run-dir points: checkpoints
    # outlive the pod, and the set restarted whole resumes from them.
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": "runs-claim"}
    (mount,) = c["volumeMounts"]
    assert mount == {"name": volume["name"], "mountPath": "/shared/runs"}
    # A SIGTERM'd pod saves at the next step: it gets Slurm's two minutes, not 30 s.
    assert pod["terminationGracePeriodSeconds"] >= 120


def test_jobset_without_a_run_dir_puts_one_on_the_volume(capsys):
    rc, out, err = k8s(capsys, "--name", "exp1", "--", "train", "--model", "tiny")
    assert rc == 0, err
    pod = yaml.safe_load(out)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["args"][c["args"].index("--run-dir") + 1] == "/runs/exp1"
    assert c["volumeMounts"][0]["mountPath"] == "/runs"


@pytest.mark.parametrize(
    "run_dir",
    ["/scratch/run", "runs/a", "/runs/../scratch/a", "/runsx/a"],
    ids=["off", "rel", "up", "sib"],
)
def test_jobset_refuses_a_run_dir_off_the_volume(capsys, run_dir):
    rc, out, err = k8s(capsys, "--", "train", "--run-dir", run_dir)
    assert rc == 2 and not out
    (line,) = err.splitlines()
    assert f"--run-dir {run_dir} is not on the run volume, mounted at /runs" in line


def test_jobset_needs_an_image_and_a_volume(capsys):
    with pytest.raises(SystemExit) as e:
        main(["k8s", "--run-volume", "c", "--", "train"])
    assert e.value.code == 2 and "--image" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["k8s", "--image", "i", "--", "train"])
    assert e.value.code == 2 and "--run-volume" in capsys.readouterr().err


def test_the_dockerfile_builds_the_package_from_the_repository():
    text = (pathlib.Path(cluster.__file__).parent / "Dockerfile").read_text()
    steps = [line.split()[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert steps[0] == "FROM" and "python:3.12" in text  # JAX 0.11 needs Python 3.12
    for part in ("pyproject.toml", "jaxdist", "models", "meshes"):
        assert re.search(rf"^COPY .*\b{part}\b", text, re.M), part
    assert re.search(r"^RUN pip install \. ", text, re.M)


@pytest.mark.parametrize("command", ["launch", "slurm", "k8s"])
def test_help_of_the_passthrough_commands(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"jaxdist {command}" in out and "-- train" in out
    assert {"launch": "--devices-per-process", "slurm": "--gpus-per-node", "k8s": "--run-volume"}[
        command
    ] in out


def test_gloo_connection_lines_are_noise_and_failures_are_not():
    ok = b"[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is"
    ok += b" : 3"
    assert gloo_noise(ok)
    assert not gloo_noise(ok.replace(b"connected to 3", b"connected to 2"))
    assert not gloo_noise(b"[Gloo] Rank 1 is NOT connected to: [0, 2]")
    assert not gloo_noise(b"step 0 loss 5.6 [Gloo] Rank 1 is connected to 3 peer ranks.")
    # Two communicators connecting at once, on two threads: their messages interleave.
    mixed = (
        b"[Gloo] Rank 0 is connected to [Gloo] Rank 0 is connected to 1 peer ranks. Expected "
        b"number of connected peer ranks is : 1\n1 peer ranks. Expected number of connected "
        b"peer ranks is : 1"
    )
    assert all(gloo_noise(line) for line in mixed.split(b"\n"))
    assert not gloo_noise(b"[Gloo] Rank 0 is connected to [Gloo] Rank 0 is NOT connected to: [1]")


def test_launch_refuses_what_it_sets_itself(capsys):
    # Both are refused before any process starts: nothing runs apart from this one.
    assert main(["launch", "--", "train", "--process-id", "0"]) == 2
    assert "launch sets --process-id itself" in capsys.readouterr().err
    assert main(["launch", "--processes", "2"]) == 2
    assert "needs the train command after --" in capsys.readouterr().err
