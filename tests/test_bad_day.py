"""A fleet's bad day, unattended: a stuck process ends the run, signals count in every process,
a restore error loses nothing, failed runs restart themselves, a local tier is restored from.

The runs are real: two processes over loopback (`jaxdist launch`) where the fault concerns
several, one process where it does not; faults are injected with `train --fault`. Every run
that finishes is checked against an uninterrupted one, step by step (rtol 1e-5)."""

import json
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from jaxdist.cli.main import main
from jaxdist.metrics import goodput
from jaxdist.metrics.goodput import read_restarts
from tests.helpers import cli, cli_popen, losses

pytestmark = pytest.mark.slow  # real processes, stalled, signalled, killed and restarted
LAUNCH_2X4 = ["launch", "--processes", "2", "--devices-per-process", "4"]
STEPS = 20


def train(steps: int, checkpoint_every: int) -> list[str]:
    """The tiny model on data=2,fsdp=2,tensor=2, steps of 8 rows of 32 tokens.

    The learning rate decays over 21 steps whatever --steps is (a run of at most 21 steps has
    that schedule anyway, warmup 20): the schedule is compiled into the step, so every launch
    here runs one program, which the session's compile cache compiles once (a 40- or 400-step
    run's own schedule cost a compile of its own)."""
    return [
        *("train", "--model", "tiny", "--mesh", "data=2,fsdp=2,tensor=2"),
        *("--steps", str(steps), "--batch-size", "8", "--seq-len", "32", "--log-every", "1"),
        *("--checkpoint-every", str(checkpoint_every), "--decay-steps", "21"),
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run, one process of 8 devices, in this process."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    assert main([*train(STEPS, 1000), "--devices", "cpu:8", "--run-dir", str(run_dir)]) == 0
    return losses(run_dir)


def _match(run_dir, reference: dict[int, float]) -> None:
    got = losses(run_dir)
    assert sorted(got) == list(range(STEPS))
    np.testing.assert_allclose(
        [got[s] for s in range(STEPS)], [reference[s] for s in range(STEPS)], rtol=1e-5
    )


def _left(run_dir) -> list[str]:
    """Processes of this run still alive."""
    found = subprocess.run(["pgrep", "-f", f"--run-dir {run_dir}"], capture_output=True, text=True)
    return found.stdout.split()


def _until(proc: subprocess.Popen, needle: str, seen: list[str]) -> float:
    """Reads the launcher's output until a line holds `needle`; the time it did."""
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return time.monotonic()
    raise AssertionError(f"{needle!r} never came:\n" + "".join(seen)[-3000:])


def _stalled(run_dir, *flags: str):
    """Two processes, process 1 stuck before step 6 for an hour; returned once it is: the run
    directory, the launcher, its output so far and the time the stall began. The run never
    gets past step 6: STEPS, as the other launches, not more."""
    args = [*train(STEPS, 4), "--run-dir", str(run_dir), "--fault", "stall:6:1:3600", *flags]
    proc = cli_popen(*LAUNCH_2X4, "--", *args)
    seen: list[str] = []
    stalled = _until(proc, "fault injected: process 1 stalls", seen)
    return run_dir, proc, seen, stalled


def _committed(run_dir) -> list[str]:
    """The checkpoint directories, committed or set aside (not Orbax's unfinished ones, which
    a start removes)."""
    names = (p.name for p in (run_dir / "checkpoints").iterdir())
    return sorted(n for n in names if "orbax-checkpoint-tmp" not in n)


def test_a_stuck_process_ends_the_run_naming_it_with_its_stacks(tmp_path):
    run_dir, proc, seen, stalled = _stalled(tmp_path / "hang", "--hang-timeout", "10")
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - stalled
    out = "".join(seen) + out
    assert proc.returncode == 124, out[-3000:]
    assert took < 10 + 30, f"{took:.0f} s from the stall to the end"
    for p in (0, 1):
        line = [x for x in out.splitlines() if x.startswith(f"[p{p}] jaxdist: hang declared")]
        assert line and "stuck: process 1 on " in line[0], out[-3000:]
        assert "(last finished step 4)" in line[0] and "Exiting 124" in line[0]
    p1 = "\n".join(x for x in out.splitlines() if x.startswith("[p1]"))
    # The stuck process's own stacks, showing where it is stuck: the injected sleep.
    assert "process 1's Python stacks" in p1 and "in before_step" in p1, p1[-3000:]
    assert "process 0's Python stacks" not in out
    # The launcher names the stuck process, whichever process happened to exit first.
    assert "jaxdist launch: failed; hang declared: stuck: process 1 on " in out, out[-3000:]
    assert "(last finished step 4) (exit 124)" in out
    assert _left(run_dir) == []


def test_sigterm_during_a_hang_ends_the_run_within_the_grace(tmp_path):
    # A grace of 3 s: what is checked is that the run ends once it is over, not its length.
    run_dir, proc, seen, _ = _stalled(tmp_path / "term", "--hang-timeout", "0", "--term-grace", "3")
    time.sleep(2)  # process 0 is inside step 6, waiting for process 1
    before = _committed(run_dir)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - signalled
    out = "".join(seen) + out
    assert proc.returncode == 143, out[-3000:]
    assert took < 3 + 30, f"{took:.0f} s from SIGTERM to the end"
    for p in (0, 1):
        assert re.search(rf"\[p{p}\] jaxdist: SIGTERM received 3 s ago .* exiting 143", out), out
    assert "checkpoint 3, the newest committed, stands" in out
    assert _committed(run_dir) == before == ["3"]  # nothing saved, nothing lost
    assert _left(run_dir) == []


def test_ctrl_c_to_a_two_process_run_saves_in_both_and_exits_zero(tmp_path):
    run_dir = tmp_path / "ctrl-c"
    proc = cli_popen(*LAUNCH_2X4, "--", *train(400, 1000), "--run-dir", str(run_dir))
    seen: list[str] = []
    _until(proc, "[p0] step   5/400", seen)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    out = "".join(seen) + out
    assert proc.returncode == 0, out[-3000:]
    assert "[p0] SIGINT received: stopping" in out and "[p1] SIGINT received: stopping" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["preempted_at"]
    assert 5 <= stopped < 30, stopped
    assert f"SIGINT received: saved step {stopped} and committed it" in out
    assert _committed(run_dir) == [str(stopped)]
    assert max(losses(run_dir)) == stopped


def test_launch_restarts_after_a_kill_a_restore_error_and_a_preemption_like_no_fault(
    tmp_path, reference
):
    """kill -9 of process 1 before step 7; then an I/O error in process 1's restore (it stops
    the run in one line and leaves at once, not held minutes in JAX's shutdown barrier, and
    process 0 ends with it); then SIGTERM to process 0 alone before step 13: three restarts,
    each resuming from the newest checkpoint; the losses are the unbroken run's."""
    run_dir = tmp_path / "restarts"
    faults = ["--fault", "kill:7:1", "--fault", "restore-error:0:1", "--fault", "term:13:0"]
    args = [*train(STEPS, 4), "--run-dir", str(run_dir), *faults, "--heartbeat-timeout", "5"]
    r = cli(*LAUNCH_2X4, "--max-restarts", "3", "--", *args, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "restart 1 of 3 after: process 1 killed by SIGKILL" in out
    assert "restart 2 of 3 after: process 1 stopped: checkpoint " in out
    assert "could not be restored (OSError: [Errno 5] Input/output error" in out
    # Process 0 alone got SIGTERM before step 13; both stopped two steps after the step at
    # which it saw it (13, or 14 if the signal's thread ran late), and saved there.
    stopped = re.search(r"restart 3 of 3 after: a signal stopped the run after step (\d+)", out)
    assert stopped and stopped[1] in ("15", "16"), out[-3000:]
    assert "resuming from checkpoint step 3" in out
    assert f"resuming from checkpoint step {stopped[1]}" in out
    _match(run_dir, reference)
    rep = goodput.read_report(run_dir)
    # The attempt whose restore failed ran no step: no record, its cause joins the one before.
    assert rep["restarts"] == 3 and len(rep["attempts"]) == 3
    causes = [a.get("restart_cause") for a in rep["attempts"]]
    assert causes[0].startswith("process 1 killed by SIGKILL; then process 1 stopped: ")
    assert "Input/output error" in causes[0]
    assert f"step {stopped[1]}" in causes[1] and rep["attempts"][2]["finished"]
    times = [x["time"] for x in read_restarts(run_dir)]
    assert times[1] - times[0] < 60, "the restore error took minutes to end the attempt"


def test_a_process_that_stops_on_an_error_ends_the_others_at_once(tmp_path):
    """Process 0's save fails (a full disk): it stops in one line and says why in the
    coordination service; process 1, waiting in the next step's collectives, ends at once
    naming it, rather than after the heartbeat timeout (100 s by default)."""
    run_dir = tmp_path / "disk-full"
    args = [*train(STEPS, 4), "--run-dir", str(run_dir), "--fault", "disk-full:5:0"]
    proc = cli_popen(*LAUNCH_2X4, "--", *args)
    seen: list[str] = []
    _until(proc, "[p0] jaxdist: stopped: checkpoint step 7 could not be written", seen)
    stopped = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    out = "".join(seen) + out
    assert proc.returncode == 1, out[-3000:]
    assert time.monotonic() - stopped < 30, out[-3000:]
    assert "[p1] jaxdist: process 0 ended the run (stopped: checkpoint step 7" in out, out[-3000:]
    assert _committed(run_dir) == ["3"] and _left(run_dir) == []
    assert not (run_dir / "restarts.jsonl").exists()  # no --max-restarts: the failure stands


def test_max_restarts_needs_a_run_dir():
    r = cli(*LAUNCH_2X4, "--max-restarts", "1", "--", *train(4, 2), timeout=60)
    assert r.returncode == 2
    assert "--max-restarts resumes each attempt" in r.stderr and "--run-dir DIR" in r.stderr


def test_a_restore_error_touches_nothing_and_the_next_run_resumes(tmp_path, reference):
    run_dir = tmp_path / "restore-error"
    args = [*train(STEPS, 4), "--devices", "cpu:8", "--run-dir", str(run_dir)]
    args += ["--fault", "kill:16:0", "--fault", "restore-error:0:0"]
    first = cli(*args, timeout=300)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    before = _committed(run_dir)
    assert before == ["11", "3", "7"]
    failed = cli(*args, timeout=300)
    assert failed.returncode == 1, failed.stderr[-3000:]
    line = failed.stderr.strip().splitlines()[-1]
    assert f"checkpoint {run_dir / 'checkpoints' / '11'} could not be restored" in line
    assert "Input/output error" in line and "left as they are" in line
    assert _committed(run_dir) == before  # nothing set aside, nothing written
    again = cli(*args, timeout=300)  # each fault fires once per run
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from checkpoint step 11" in again.stderr
    _match(run_dir, reference)


def test_checkpoints_that_all_fail_to_restore_never_restart_at_step_zero(tmp_path):
    run_dir = tmp_path / "all-damaged"
    args = [*train(8, 4), "--devices", "cpu:8", "--run-dir", str(run_dir)]
    assert cli(*args, timeout=300).returncode == 0
    for step in _committed(run_dir):  # damaged for real: the record does not parse
        (run_dir / "checkpoints" / step / "meta" / "metadata").write_text("{torn")
    longer = [*train(12, 4), "--devices", "cpu:8", "--run-dir", str(run_dir)]
    refused = cli(*longer, timeout=300)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert "holds checkpoints but none restores" in refused.stderr
    assert "--allow-fresh-start" in refused.stderr
    assert _committed(run_dir) == ["3.damaged", "7.damaged"]
    assert max(losses(run_dir)) == 7  # no step ran again
    fresh = cli(*longer, "--allow-fresh-start", timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert _committed(run_dir) == ["11", "3", "3.damaged", "7", "7.damaged"]


def test_the_local_tier_is_restored_from_when_newer_and_skipped_when_lost(tmp_path, reference):
    local = tmp_path / "node-local"
    args = [*train(STEPS, 10), "--devices", "cpu:8", "--fault", "kill:13:0"]
    args += ["--local-checkpoint-dir", str(local), "--local-checkpoint-every", "2"]
    kept, lost = tmp_path / "kept", tmp_path / "lost"
    for run_dir in (kept, lost):
        killed = cli(*args, "--run-dir", str(run_dir), timeout=300)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert _committed(run_dir) == ["9"]
        if run_dir == lost:  # the node is replaced: its local disk is gone
            shutil.rmtree(local)
        resumed = cli(*args, "--run-dir", str(run_dir), timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        found = re.search(r"resuming from checkpoint step (\d+)( \(local tier\))?", resumed.stderr)
        assert found, resumed.stderr[-3000:]
        if run_dir == kept:  # saved every 2 steps locally: 10 or 12 (12's write may be cut)
            assert int(found[1]) in (10, 12) and found[2], found[0]
        else:
            assert found[1] == "9" and not found[2], found[0]
        _match(run_dir, reference)
