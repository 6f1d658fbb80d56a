"""Crash and preemption, as they happen: real processes, kill -9, SIGTERM, Ctrl-C twice,
relaunch.

One run meets them all in turn, as a run on a bad day does: started without --run-dir and
stopped by Ctrl-C twice; resumed as the message says, ten times, each time killed with kill -9
at a random moment; resumed and stopped by SIGTERM; resumed to its end. Each interruption's
tests read what it did; every one of them ends in the same check, that the losses of every step
are those of an uninterrupted run, bitwise."""

import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxdist.checkpoint import abandon
from jaxdist.checkpoint.damage import list_checkpoints
from jaxdist.cli.main import main
from jaxdist.metrics.records import read_metrics
from tests.helpers import CLI_ENV, JAXDIST, losses

slow = pytest.mark.slow  # real processes killed and relaunched, one run of about a minute
# Room for every interruption: each attempt runs on from its checkpoint, and the run must not
# end before the last one. Steps of 8 rows of 32 tokens (about 0.05 s, not 0.3 s at 16 x 128):
# each attempt reruns steps, and what is checked does not depend on their size.
STEPS = 60


def train(checkpoint_every: int) -> list[str]:
    return [
        *("train", "--model", "tiny", "--mesh", "data=2,fsdp=2,tensor=2", "--devices", "cpu:8"),
        *("--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--log-every", "1"),
        *("--checkpoint-every", str(checkpoint_every)),
    ]


ARGS = train(checkpoint_every=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run, in this process (nothing here interrupts it), saving only at its
    end: saves must not change what a run computes either."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    assert main([*train(checkpoint_every=1000), "--run-dir", str(run_dir)]) == 0
    return losses(run_dir)


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _start(cwd: pathlib.Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*JAXDIST, *ARGS, *extra],
        cwd=cwd,
        env=CLI_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _tmp_dirs(directory: pathlib.Path) -> list[str]:
    return [q.name for q in directory.iterdir() if abandon.TMP_SUFFIX in q.name]


def _ctrl_c_twice(cwd: pathlib.Path) -> dict:
    """A new run, no --run-dir (it makes its own runs/<time>, and its message must name it),
    stopped by Ctrl-C, then Ctrl-C again while the save the first one asked for is written."""
    p = _start(cwd)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
    reader.start()
    assert _wait(lambda: (cwd / "runs").is_dir() and any((cwd / "runs").iterdir()), 120)
    (run_dir,) = (cwd / "runs").iterdir()
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
    took = time.monotonic() - sent
    reader.join(timeout=10)
    return {
        "run_dir": run_dir,
        "returncode": p.returncode,
        "took": took,
        "err": "".join(lines),
        "tmp_dirs": _tmp_dirs(ckpt),
        "rows": list_checkpoints(run_dir),
    }


def _kill9_ten_times(cwd: pathlib.Path, rerun: list[str]) -> dict:
    rng = random.Random(1234)
    run_dir = cwd / rerun[-1]
    ckpt_dir = run_dir / "checkpoints"
    kills, during_save, errs = 0, 0, []
    while kills < 10:
        p = _start(cwd, *rerun)
        lines = len(read_metrics(run_dir / "metrics.jsonl"))
        if kills % 3 == 0:
            time.sleep(rng.uniform(0.2, 3.0))  # anywhere: import, compile, restore
        elif kills % 3 == 1:  # the moment an async save is writing
            # Counted as seen, not looked up again: a save may finish in between.
            during_save += _wait(lambda: bool(_tmp_dirs(ckpt_dir)), 30)
        else:  # mid-training, a little after a few new steps were logged
            _wait(lambda n=lines: len(read_metrics(run_dir / "metrics.jsonl")) > n + 3, 30)
            time.sleep(rng.uniform(0.0, 0.3))
        if p.poll() is not None:
            break  # finished before the blow landed
        p.send_signal(signal.SIGKILL)
        errs.append(p.communicate()[1])
        kills += 1
    return {"kills": kills, "during_save": during_save, "errs": errs}


def _sigterm(cwd: pathlib.Path, rerun: list[str]) -> dict:
    run_dir = cwd / rerun[-1]
    lines = len(read_metrics(run_dir / "metrics.jsonl"))
    p = _start(cwd, *rerun)
    assert _wait(lambda: len(read_metrics(run_dir / "metrics.jsonl")) >= lines + 5, 120)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    return {"returncode": p.returncode, "err": err, "rows": list_checkpoints(run_dir)}


@pytest.fixture(scope="module")
def bad_day(tmp_path_factory) -> dict:
    """The run, through every interruption in turn, then to its end; what each one left."""
    cwd = tmp_path_factory.mktemp("bad-day")
    ctrl_c = _ctrl_c_twice(cwd)
    # What the second Ctrl-C says to do, from the same directory: --run-dir runs/<time>.
    rerun = ["--run-dir", str(ctrl_c["run_dir"].relative_to(cwd))]
    kill9 = _kill9_ten_times(cwd, rerun)
    sigterm = _sigterm(cwd, rerun)
    final = subprocess.run(
        [*JAXDIST, *ARGS, *rerun], cwd=cwd, env=CLI_ENV, capture_output=True, text=True, timeout=300
    )
    assert final.returncode == 0, final.stderr
    return {
        "cwd": cwd,
        "run_dir": ctrl_c["run_dir"],
        "ctrl_c": ctrl_c,
        "kill9": kill9,
        "sigterm": sigterm,
        "final_err": final.stderr,
        "losses": losses(ctrl_c["run_dir"]),
    }


@slow
def test_kill9_at_random_moments_then_resume_is_bitwise(bad_day, reference):
    kill9 = bad_day["kill9"]
    assert kill9["kills"] >= 10 and kill9["during_save"] >= 1
    got = bad_day["losses"]
    assert sorted(got) == list(range(STEPS))
    assert got == reference  # bitwise: same floats, every step
    assert "resuming from checkpoint step" in bad_day["final_err"]


@slow
def test_sigterm_saves_commits_and_exits_zero(bad_day, reference):
    sigterm = bad_day["sigterm"]
    err = sigterm["err"]
    assert sigterm["returncode"] == 0, err
    assert "SIGTERM received: saved step" in err
    # It names the run directory to resume, exactly.
    rel = bad_day["run_dir"].relative_to(bad_day["cwd"])
    assert f"to resume, rerun the same command with --run-dir {rel}" in err
    stopped_at = int(err.split("SIGTERM received: saved step ")[1].split()[0])
    rows = [r for r in sigterm["rows"] if r["valid"]]
    assert max(r["step"] for r in rows) == stopped_at < STEPS - 1
    assert f"at step {stopped_at + 1}" in bad_day["final_err"]
    assert bad_day["losses"] == reference


@slow
def test_ctrl_c_twice_ends_at_once_in_one_line_and_leaves_no_partial_checkpoint(bad_day, reference):
    ctrl_c = bad_day["ctrl_c"]
    assert ctrl_c["returncode"] == 130 and ctrl_c["took"] < 10
    err = ctrl_c["err"]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    # After the first one's notice: the steps that finished meanwhile, then one line.
    *steps, last = err.split("Ctrl-C again stops at once, without it\n", 1)[1].splitlines()
    assert all(x.startswith("step ") for x in steps), steps
    assert not ctrl_c["tmp_dirs"]
    rows = ctrl_c["rows"]
    assert rows and all(r["valid"] for r in rows)  # every checkpoint left is a committed one
    newest = max(r["step"] for r in rows)
    rel = bad_day["run_dir"].relative_to(bad_day["cwd"])
    assert last.startswith("jaxdist: stopped at once (second Ctrl-C), without saving")
    assert last.endswith(
        f"checkpoint {newest} is the newest; to resume from it, rerun the same command with "
        f"--run-dir {rel}"
    )
    # What it says to do resumes the run, from that checkpoint (the first rerun that got that
    # far before its kill -9 says so), and in the end bitwise.
    said = [e for e in bad_day["kill9"]["errs"] if "resuming from checkpoint step" in e]
    assert said, bad_day["kill9"]["errs"]
    assert f"resuming from checkpoint step {newest} " in " ".join(said[0].split())
    assert bad_day["losses"] == reference


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
