"""Crash and preemption, as they happen: real processes, kill -9, SIGTERM, relaunch."""

import pathlib
import random
import signal
import subprocess
import time

import pytest

from jaxdist.checkpoint.store import list_checkpoints
from jaxdist.metrics.records import read_metrics
from tests.helpers import cli_popen, losses, tiny_train

pytestmark = pytest.mark.slow  # real processes killed and relaunched, 10-30 s each
STEPS = 40
ARGS = [*tiny_train(STEPS, checkpoint_every=2), "--devices", "cpu:8"]


def launch(run_dir: pathlib.Path) -> subprocess.Popen:
    return cli_popen(*ARGS, "--run-dir", str(run_dir), merge_output=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    p = launch(run_dir)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    return losses(run_dir)


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_kill9_at_random_moments_then_resume_is_bitwise(tmp_path, reference):
    rng = random.Random(1234)
    ckpt_dir = tmp_path / "checkpoints"
    kills, during_save = 0, 0
    while kills < 10:
        p = launch(tmp_path)
        lines = len(read_metrics(tmp_path / "metrics.jsonl"))
        if kills % 3 == 0:
            time.sleep(rng.uniform(0.2, 3.0))  # anywhere: import, compile, restore
        elif kills % 3 == 1:  # the moment an async save is writing
            _wait(
                lambda: (
                    ckpt_dir.is_dir()
                    and any(".orbax-checkpoint-tmp" in q.name for q in ckpt_dir.iterdir())
                ),
                30,
            )
            during_save += any(".orbax-checkpoint-tmp" in q.name for q in ckpt_dir.iterdir())
        else:  # mid-training, a little after a few new steps were logged
            _wait(lambda n=lines: len(read_metrics(tmp_path / "metrics.jsonl")) > n + 3, 30)
            time.sleep(rng.uniform(0.0, 0.3))
        if p.poll() is not None:
            break  # finished before the blow landed
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
    p = launch(tmp_path)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert kills >= 10 and during_save >= 1
    got = losses(tmp_path)
    assert sorted(got) == list(range(STEPS))
    assert got == reference  # bitwise: same floats, every step
    assert "resuming from checkpoint step" in err


def test_sigterm_saves_commits_and_exits_zero(tmp_path, reference):
    p = launch(tmp_path)
    assert _wait(lambda: len(read_metrics(tmp_path / "metrics.jsonl")) >= 5, 120)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "SIGTERM received: saved step" in err
    stopped_at = int(err.split("SIGTERM received: saved step ")[1].split()[0])
    rows = [r for r in list_checkpoints(tmp_path) if r["valid"]]
    assert max(r["step"] for r in rows) == stopped_at < STEPS - 1
    p = launch(tmp_path)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0 and f"at step {stopped_at + 1}" in err
    assert losses(tmp_path) == reference
