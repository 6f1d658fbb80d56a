"""Several processes, one run: same losses as one process, checkpoints across process
counts, a dead process ends the run loudly, and a relaunch resumes."""

import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from jaxdist.cluster.launch import free_port
from jaxdist.metrics.records import read_metrics
from tests.helpers import cli, cli_popen, losses, tiny_train

pytestmark = pytest.mark.slow  # real processes, 12-30 s each
STEPS = 8
TRAIN = tiny_train(STEPS, checkpoint_every=4)
LAUNCH_2X4 = ["launch", "--processes", "2", "--devices-per-process", "4", "--"]


def one_process(run_dir, *extra, timeout=300):
    r = cli(*TRAIN, "--devices", "cpu:8", "--run-dir", str(run_dir), *extra, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r


def two_processes(run_dir, *extra, timeout=300):
    r = cli(*LAUNCH_2X4, *TRAIN, "--run-dir", str(run_dir), *extra, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one")
    one_process(run_dir)
    return losses(run_dir)


def test_two_processes_match_one(tmp_path, reference):
    r = two_processes(tmp_path)
    got = losses(tmp_path)
    assert sorted(got) == list(range(STEPS))
    np.testing.assert_allclose(
        [got[s] for s in range(STEPS)], [reference[s] for s in range(STEPS)], rtol=1e-5
    )
    assert "[p0] step" in r.stderr and "[p1] step" not in r.stderr  # process 0 alone logs


def _cut_after(run_dir, step):
    """As if the run had died right after checkpointing `step`: later state is gone."""
    import shutil

    for d in (run_dir / "checkpoints").iterdir():
        if d.name.isdigit() and int(d.name) > step:
            shutil.rmtree(d)
    kept = [
        line
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line and int(re.search(r'"step": (\d+)', line).group(1)) <= step
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(kept) + "\n")


@pytest.mark.parametrize("first, then", [("two", "one"), ("one", "two")])
def test_checkpoint_restores_across_process_counts(tmp_path, reference, first, then):
    run = {"one": one_process, "two": two_processes}
    run[first](tmp_path)
    _cut_after(tmp_path, 3)
    r = run[then](tmp_path)
    assert "resuming from checkpoint step 3" in r.stderr
    got = losses(tmp_path)
    np.testing.assert_allclose(
        [got[s] for s in range(STEPS)], [reference[s] for s in range(STEPS)], rtol=1e-5
    )


def test_dead_process_ends_the_run_naming_it_then_relaunch_resumes(tmp_path):
    long_run = [*TRAIN, "--steps", "400", "--run-dir", str(tmp_path), "--heartbeat-timeout", "5"]
    launcher = cli_popen(*LAUNCH_2X4, *long_run)
    deadline = time.monotonic() + 120
    while len(read_metrics(tmp_path / "metrics.jsonl")) < 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    victim = subprocess.run(
        ["pgrep", "-f", f"{tmp_path}.*--process-id 1"], capture_output=True, text=True
    ).stdout.split()
    assert len(victim) == 1, victim
    os.kill(int(victim[0]), signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = launcher.communicate(timeout=120)
    waited = time.monotonic() - t0
    assert launcher.returncode != 0
    assert waited < 60, f"the survivor took {waited:.0f} s to stop"
    assert "process 1 was first to fail" in out, out[-3000:]
    # The survivor's own message, from JAX's coordination service, names the lost task too.
    # Its wording varies with timing: "Task 1 heartbeat timeout", or "The following tasks are
    # unhealthy (stopped sending heartbeats):" followed by a line holding just "1".
    p0 = "\n".join(
        line.removeprefix("[p0] ") for line in out.splitlines() if line.startswith("[p0]")
    )
    assert re.search(r"(?i)task 1 heartbeat timeout|stopped sending heartbeats\):\s*\n1\n", p0), (
        out[-3000:]
    )

    # Relaunch: it resumes; then a SIGTERM to the launcher reaches both processes, which
    # save and exit 0, as a preempted job does.
    relaunch = cli_popen(*LAUNCH_2X4, *long_run)
    seen = []
    for line in relaunch.stdout:
        seen.append(line)
        if "[p0] step" in line:
            break
    assert any("resuming from checkpoint step" in x for x in seen), "".join(seen)[-3000:]
    relaunch.send_signal(signal.SIGTERM)
    rest, _ = relaunch.communicate(timeout=120)
    assert relaunch.returncode == 0, rest[-3000:]
    assert "SIGTERM received: saved step" in rest


def test_slow_step_is_reported_with_the_process_not_yet_arrived(tmp_path):
    r = two_processes(
        tmp_path, "--steps", "12", "--fault-stall", "9:1:12", "--slow-step-factor", "3"
    )
    line = [x for x in r.stderr.splitlines() if "slow step" in x and x.startswith("[p0]")]
    assert line, r.stderr[-3000:]
    assert "not yet arrived: process 1" in line[0]


def test_launch_output_holds_no_gloo_connection_lines(tmp_path):
    # Gloo prints one such line per communicator it connects (32 before the first step here).
    r = cli(*LAUNCH_2X4, "train", "--steps", "3", "--run-dir", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[p0] step" in r.stderr
    assert "[Gloo]" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]


def test_a_mesh_too_small_for_the_processes_devices_names_the_per_process_count(tmp_path):
    # Two processes without --devices: 8 fake devices each, 16 in all, for an 8-device mesh.
    port = free_port()
    procs = [
        cli_popen(
            "train",
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
