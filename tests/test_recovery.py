"""Crash and preemption, as they happen: real processes, kill -9, SIGTERM, Ctrl-C twice,
relaunch."""

import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxdist.checkpoint import abandon
from jaxdist.checkpoint.store import list_checkpoints
from jaxdist.metrics.records import read_metrics
from tests.helpers import CLI_ENV, JAXDIST, cli_popen, losses, tiny_train

slow = pytest.mark.slow  # real processes killed and relaunched, 10-30 s each
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


@slow
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


@slow
def test_sigterm_saves_commits_and_exits_zero(tmp_path, reference):
    p = launch(tmp_path)
    assert _wait(lambda: len(read_metrics(tmp_path / "metrics.jsonl")) >= 5, 120)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "SIGTERM received: saved step" in err
    # It names the run directory to resume, exactly.
    assert f"to resume, rerun the same command with --run-dir {tmp_path}" in err
    stopped_at = int(err.split("SIGTERM received: saved step ")[1].split()[0])
    rows = [r for r in list_checkpoints(tmp_path) if r["valid"]]
    assert max(r["step"] for r in rows) == stopped_at < STEPS - 1
    p = launch(tmp_path)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0 and f"at step {stopped_at + 1}" in err
    assert losses(tmp_path) == reference


def _tmp_dirs(directory: pathlib.Path) -> list[str]:
    return [q.name for q in directory.iterdir() if abandon.TMP_SUFFIX in q.name]


@slow
def test_ctrl_c_twice_ends_at_once_in_one_line_and_leaves_no_partial_checkpoint(
    tmp_path, reference
):
    # No --run-dir: the run makes its own (runs/<time>), and the message must name it.
    p = subprocess.Popen(
        [*JAXDIST, *ARGS],
        cwd=tmp_path,
        env=CLI_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
    reader.start()
    assert _wait(lambda: (tmp_path / "runs").is_dir() and any((tmp_path / "runs").iterdir()), 120)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert _wait(lambda: len(read_metrics(run_dir / "metrics.jsonl")) >= 5, 120)
    p.send_signal(signal.SIGINT)
    # Sent apart, or the kernel delivers the two as one: after the first was seen...
    assert _wait(lambda: any("SIGINT received" in x for x in lines), 30), lines
    # ...and, where it can be caught, while the save the first asked for is being written.
    ckpt = run_dir / "checkpoints"
    _wait(lambda: bool(_tmp_dirs(ckpt)), 30)
    assert p.poll() is None, "".join(lines)
    p.send_signal(signal.SIGINT)
    sent = time.monotonic()
    p.wait(timeout=60)
    reader.join(timeout=10)
    assert p.returncode == 130 and time.monotonic() - sent < 10
    err = "".join(lines)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    # After the first one's notice: the steps that finished meanwhile, then one line.
    *steps, last = err.split("Ctrl-C again stops at once, without it\n", 1)[1].splitlines()
    assert all(x.startswith("step ") for x in steps), steps
    assert not _tmp_dirs(ckpt)
    rows = list_checkpoints(run_dir)
    assert rows and all(r["valid"] for r in rows)  # every checkpoint left is a committed one
    newest = max(r["step"] for r in rows)
    rel = run_dir.relative_to(tmp_path)
    assert last.startswith("jaxdist: stopped at once (second Ctrl-C), without saving")
    assert last.endswith(
        f"checkpoint {newest} is the newest; to resume from it, rerun the same command with "
        f"--run-dir {rel}"
    )
    # What it says to do resumes the run, from that checkpoint, bitwise.
    r = subprocess.run(
        [*JAXDIST, *ARGS, "--run-dir", str(rel)],
        cwd=tmp_path,
        env=CLI_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert f"resuming from checkpoint step {newest} " in " ".join(r.stderr.split())
    assert losses(run_dir) == reference


def test_ending_at_once_removes_only_the_unfinished_save(tmp_path):
    """The cleanup a second Ctrl-C execs into, on a directory laid out by hand: an Orbax
    temporary directory is removed, committed checkpoints are not touched."""
    committed = tmp_path / "3" / "state"
    committed.mkdir(parents=True)
    (committed / "data").write_bytes(b"x" * 100)
    (tmp_path / "1").mkdir()
    partial = tmp_path / "5.orbax-checkpoint-tmp-1733000000" / "state" / "ocdbt.process_0"
    partial.mkdir(parents=True)
    (partial / "d").write_bytes(b"y" * 10)
    (tmp_path / "2.damaged").mkdir()  # set aside by an earlier restore: kept
    r = subprocess.run(
        [sys.executable, "-I", "-S", abandon.__file__, str(tmp_path), "rerun with --run-dir R"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 130
    assert r.stderr == (
        "jaxdist: stopped at once (second Ctrl-C), without saving; the unfinished save of step "
        "5 was removed; checkpoint 3 is the newest; to resume from it, rerun with --run-dir R\n"
    )
    assert sorted(q.name for q in tmp_path.iterdir()) == ["1", "2.damaged", "3"]
    assert (committed / "data").read_bytes() == b"x" * 100
