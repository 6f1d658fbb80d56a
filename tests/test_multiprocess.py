"""Several processes, one run: same losses as one process, checkpoints across process
counts, a slow step names the process not yet arrived, a dead process ends the run loudly,
and a relaunch resumes.

Every launch here runs the same program as the one-process runs (the tiny model on the cpu8
layout; any run of at most 21 steps has the same learning-rate schedule, warmup 20), so the
session's compile cache compiles it once. The one-process runs are in this process (the CLI's
own main): a second process is what the launches are about, not what they are checked
against."""

import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from jaxdist.cli.main import main
from jaxdist.cluster.launch import free_port
from tests.helpers import cli, cli_popen, losses, tiny_train

pytestmark = pytest.mark.slow  # real processes, 10-30 s each
STEPS = 8
TRAIN = tiny_train(STEPS, checkpoint_every=4)
LAUNCH_2X4 = ["launch", "--processes", "2", "--devices-per-process", "4", "--"]


def one_process(run_dir, capsys=None) -> str:
    """`jaxdist train` as one process of 8 devices, in this process; its stderr."""
    rc = main([*TRAIN, "--devices", "cpu:8", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err if capsys else ""
    assert rc == 0, err
    return err


def no_gloo_lines(out: str) -> None:
    # Gloo prints one line per communicator it connects (32 before the first step of this
    # run); the launch must pass none of them on.
    assert "[Gloo]" not in out, out[-3000:]


def two_processes(run_dir) -> str:
    r = cli(*LAUNCH_2X4, *TRAIN, "--run-dir", str(run_dir), timeout=300)
    assert r.returncode == 0, r.stderr
    no_gloo_lines(r.stdout + r.stderr)
    return r.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted one-process run: its directory and its losses."""
    run_dir = tmp_path_factory.mktemp("one")
    one_process(run_dir)
    return run_dir, losses(run_dir)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """An uninterrupted two-process run: its directory and the launcher's output."""
    run_dir = tmp_path_factory.mktemp("two")
    return run_dir, two_processes(run_dir)


def _match(got: dict, reference: dict) -> None:
    assert sorted(got) == list(range(STEPS))
    np.testing.assert_allclose(
        [got[s] for s in range(STEPS)], [reference[s] for s in range(STEPS)], rtol=1e-5
    )


def test_two_processes_match_one(launched, reference):
    run_dir, err = launched
    _match(losses(run_dir), reference[1])
    assert "[p0] step" in err and "[p1] step" not in err  # process 0 alone logs


def _cut_after(src, run_dir, step):
    """A copy of the finished run `src`, as if it had died right after checkpointing `step`:
    later state is gone."""
    shutil.copytree(src, run_dir, dirs_exist_ok=True)
    for d in (run_dir / "checkpoints").iterdir():
        if d.name.isdigit() and int(d.name) > step:
            shutil.rmtree(d)
    kept = [
        line
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line and int(re.search(r'"step": (\d+)', line).group(1)) <= step
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(kept) + "\n")


def test_checkpoint_of_two_processes_restores_in_one(tmp_path, launched, reference, capsys):
    _cut_after(launched[0], tmp_path, 3)
    err = one_process(tmp_path, capsys)
    assert "resuming from checkpoint step 3" in err
    _match(losses(tmp_path), reference[1])


def test_checkpoint_of_one_process_restores_in_two(tmp_path, reference):
    _cut_after(reference[0], tmp_path, 3)
    err = two_processes(tmp_path)
    assert "resuming from checkpoint step 3" in err
    _match(losses(tmp_path), reference[1])


@pytest.fixture(scope="module")
def dead(tmp_path_factory):
    """A two-process run whose process 1 stalls before step 6 (so process 0 waits in step 6's
    collectives) and is killed with SIGKILL once process 0 has reported the slow step.
    Returns the run directory, its arguments and the launcher's output."""
    run_dir = tmp_path_factory.mktemp("dead")
    # 20 steps: room for the relaunch's SIGTERM to land before the end.
    run = [*tiny_train(20, 4), "--run-dir", str(run_dir), "--heartbeat-timeout", "5"]
    # The stall outlasts what the test waits for: the run is held there, not raced.
    stall = ["--fault-stall", "6:1:120", "--slow-step-factor", "3"]
    launcher = cli_popen(*LAUNCH_2X4, *run, *stall)
    seen = []
    for line in launcher.stdout:
        seen.append(line)
        if line.startswith("[p0] slow step"):
            break
    victim = subprocess.run(
        ["pgrep", "-f", f"{run_dir}.*--process-id 1"], capture_output=True, text=True
    ).stdout.split()
    assert len(victim) == 1, (victim, "".join(seen)[-3000:])
    os.kill(int(victim[0]), signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = launcher.communicate(timeout=120)
    return run_dir, run, "".join(seen) + out, launcher.returncode, time.monotonic() - t0


def test_slow_step_is_reported_with_the_process_not_yet_arrived(dead):
    out = dead[2]
    line = [x for x in out.splitlines() if "slow step" in x and x.startswith("[p0]")]
    assert line, out[-3000:]
    # Process 0 finished step 5 and waits in step 6; process 1 sleeps before step 6.
    assert "slow step 6:" in line[0] and "not yet arrived: process 1" in line[0]


def test_dead_process_ends_the_run_naming_it_then_relaunch_resumes(dead):
    run_dir, run, out, returncode, waited = dead
    assert returncode != 0
    assert waited < 60, f"the survivor took {waited:.0f} s to stop"
    assert "process 1 was first to fail" in out, out[-3000:]
    no_gloo_lines(out)
    # The survivor's own message, from JAX's coordination service, names the lost task too.
    # Its wording varies with timing: "Task 1 heartbeat timeout", or "The following tasks are
    # unhealthy (stopped sending heartbeats):" followed by a line holding just "1".
    p0 = "\n".join(
        line.removeprefix("[p0] ") for line in out.splitlines() if line.startswith("[p0]")
    )
    assert re.search(r"(?i)task 1 heartbeat timeout|stopped sending heartbeats\):\s*\n1\n", p0), (
        out[-3000:]
    )

    # Relaunch (without the stall): it resumes; then a SIGTERM to the launcher reaches both
    # processes, which save and exit 0, as a preempted job does.
    relaunch = cli_popen(*LAUNCH_2X4, *run)
    seen = []
    for line in relaunch.stdout:
        seen.append(line)
        if "[p0] step" in line:
            break
    assert any("resuming from checkpoint step 3" in x for x in seen), "".join(seen)[-3000:]
    relaunch.send_signal(signal.SIGTERM)
    rest, _ = relaunch.communicate(timeout=120)
    assert relaunch.returncode == 0, rest[-3000:]
    assert "SIGTERM received: saved step" in rest
    no_gloo_lines("".join(seen) + rest)


def test_a_mesh_too_small_for_the_processes_devices_names_the_per_process_count(tmp_path):
    # Two processes without --devices: 8 fake devices each, 16 in all, for an 8-device mesh
    # (named: --mesh auto would fit the 16).
    port = free_port()
    procs = [
        cli_popen(
            "train",
            "--mesh",
            "cpu8",
            "--steps",
            "1",
            "--run-dir",
            str(tmp_path),
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    for out in outs:
        assert "needs 8 devices but 16 are present (2 processes together)" in out, out[-2000:]
        assert "--devices cpu:4 on a CPU host" in out
