"""Watching a run: TensorBoard events read back by TensorBoard's own reader, and goodput
accounting: a ledger driven by a fake clock, its every part known, and a real run killed
with kill -9 twice and resumed, against the wall-clock this test measures apart.

The run's attempts are processes of their own (killed; each attempt's start is its process's);
`jaxdist goodput` runs in this process, main() read by capsys."""

import json
import pathlib
import re
import signal
import time

import numpy as np
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxdist.cli.main import main
from jaxdist.metrics import goodput
from jaxdist.metrics.goodput import ALL_PARTS, PARTS, Ledger, print_report, read_report, report
from jaxdist.metrics.records import MetricsLog, latest_per_step, read_metrics
from jaxdist.metrics.tensorboard import TensorBoardLog
from tests.helpers import cli, cli_popen, tiny_train

# Checkpoints at steps 3, 7, 11 and 13. The kills (once a step past 4 is logged, then 3 steps
# past the first attempt's last) land between checkpoints 3 and 7, then 7 and 11: each resume
# recomputes steps. At most 21 steps: the learning-rate schedule, and so the step program, of
# the session's other short tiny runs (compiled once, then read back from the cache).
STEPS = 14
ARGS = [*tiny_train(STEPS, checkpoint_every=4), "--devices", "cpu:8"]


def tensorboard(tb_dir: pathlib.Path) -> EventAccumulator:
    acc = EventAccumulator(str(tb_dir))  # purge_orphaned_data is on, as in TensorBoard
    acc.Reload()
    return acc


def last_per_step(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}  # in read order: the last one wins


# --- fast: the pieces in-process ---


class FakeClock:
    """The ledger's two clocks (time.time, time.perf_counter) as one that moves only when the
    test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _attempt(monkeypatch, clock, metrics, process_start, ledger_at, restore, resume_at):
    """A process started at `process_start` whose ledger is made at `ledger_at`, restores for
    `restore` s and resumes at step `resume_at`, its records stamped as the loop stamps them."""
    monkeypatch.setattr(goodput, "process_start", lambda: process_start)
    clock.now = ledger_at
    ledger = Ledger()
    clock.advance(restore)
    ledger.begin(resume_at, read_metrics(metrics))
    return ledger, MetricsLog(metrics, stamp=ledger.fields)


def _step(clock, ledger, log, s, data_s, step_s):
    with ledger.part("data"):
        clock.advance(data_s)
    clock.advance(step_s)
    ledger.step(s)
    log.write({"step": s, "loss": 1.0})


def test_goodput_of_a_ledger_whose_parts_are_known(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(goodput, "time", clock)
    metrics = tmp_path / "metrics.jsonl"
    # Attempt 1: started at 1000 s, 3 s of imports before the ledger, 1.5 s restoring (a fresh
    # init), 0.5 s more setup; step 0 compiles in 4 s, steps 1..5 take 1 s; 0.25 s of data
    # each; a 0.75 s save after step 3, a 2 s eval after step 4. Then 7 s of a step that no
    # record tells of, and kill -9.
    ledger, log = _attempt(monkeypatch, clock, metrics, 1000.0, 1003.0, 1.5, 0)
    clock.advance(0.5)
    ledger.mark("startup")
    for s in range(6):
        _step(clock, ledger, log, s, 0.25, 4.0 if s == 0 else 1.0)
        if s == 3:
            with ledger.part("checkpoint"):
                clock.advance(0.75)
            log.write({"event": "save", "step": 3, "blocked_s": 0.75})
        if s == 4:
            with ledger.part("eval"):
                clock.advance(2.0)
    clock.advance(7.0)
    log.close()
    # Attempt 2: started at 1030 s, 2 s of imports, 1 s restoring step 3's checkpoint, 0.25 s
    # setup; step 4 compiles in 3 s, 5 is run again (1 s), 6 and 7 are new (1 s each), 0.25 s
    # of data each; the last save blocks 0.5 s and its commit 0.25 s more.
    ledger, log = _attempt(monkeypatch, clock, metrics, 1030.0, 1032.0, 1.0, 4)
    clock.advance(0.25)
    ledger.mark("startup")
    for s in range(4, 8):
        _step(clock, ledger, log, s, 0.25, 3.0 if s == 4 else 1.0)
    with ledger.part("checkpoint"):
        clock.advance(0.5)
    with ledger.part("checkpoint"):
        clock.advance(0.25)
    log.write({"event": "end"})
    log.close()

    rep = read_report(tmp_path)
    first = {"startup": 3.5, "restore": 1.5, "compile": 4.0, "productive": 5.0}
    first |= {"recomputed": 0.0, "data": 1.5, "checkpoint": 0.75, "eval": 2.0}
    second = {"startup": 2.25, "restore": 1.0, "compile": 3.0, "productive": 2.0}
    second |= {"recomputed": 1.0, "data": 1.0, "checkpoint": 0.75, "eval": 0.0}
    # Attempt 1's records end 18.25 s after its start (the parts above); the next process
    # starts 11.75 s later: the 7 s lost with the killed step and 4.75 s before the restart.
    first["between"], second["between"] = 11.75, 0.0
    a, b = rep["attempts"]
    assert (a["parts_s"], b["parts_s"]) == (pytest.approx(first), pytest.approx(second))
    assert (a["process_start"], a["end"]) == (1000.0, pytest.approx(1018.25))
    assert (b["process_start"], b["end"]) == (1030.0, pytest.approx(1041.0))
    assert (a["first_step"], a["last_step"], a["recompute"]) == (0, 5, None)
    assert (b["first_step"], b["last_step"], b["recompute"]) == (4, 7, [4, 5])
    # Step 4, compiled again, and 5 are steps attempt 1 had run: both redone.
    assert a["steps"] == {"productive": 6, "recomputed": 0}
    assert b["steps"] == {"productive": 2, "recomputed": 2}
    assert (a["finished"], b["finished"]) == (False, True)
    assert rep["parts_s"] == pytest.approx({k: first[k] + second[k] for k in ALL_PARTS})
    assert rep["wall_s"] == pytest.approx(41.0)  # 1000 s to 1041 s
    assert rep["goodput"] == pytest.approx(7.0 / 41.0)  # 5 + 2 productive seconds
    assert rep["recomputed_steps"] == 2
    # Each attempt says where it started once, in its first record.
    assert [r["step"] for r in read_metrics(metrics) if "attempt" in r] == [0, 4]


def test_report_adds_the_time_between_attempts():
    def attempt(start, first, parts, finished):
        said = {"process_start": start, "first_step": first, "recompute": None}
        return [
            {"step": first, "loss": 1.0, "goodput_s": parts, "attempt": said},
            *([{"event": "end", "goodput_s": parts}] if finished else []),
        ]

    a = dict.fromkeys(PARTS, 1.0)  # 8 s each
    rep = report(attempt(100.0, 0, a, False) + attempt(110.0, 4, a, True))
    first, second = rep["attempts"]
    assert first["parts_s"]["between"] == pytest.approx(2.0)  # 108 -> 110
    assert not first["finished"] and second["finished"]
    assert rep["wall_s"] == pytest.approx(18.0)  # 100 s to 110 s + 8 s
    assert rep["goodput"] == pytest.approx(2 / 18)


def test_tensorboard_keeps_a_resumes_values_and_drops_what_it_recomputed(tmp_path):
    tb = tmp_path / "tb"
    first = TensorBoardLog(tb, first_step=0)
    for s in range(10):
        first.write({"step": s, "loss": 10.0 + s, "finite": True, "mfu": None, "time": 1.0})
    first.write({"event": "save", "step": 4, "blocked_s": 0.5})
    first.close()
    killed = sorted(tb.iterdir())[-1]
    with killed.open("ab") as f:
        f.write(b"\x10\x00\x00")  # a record cut short by kill -9
    resumed = TensorBoardLog(tb, first_step=5)  # restored the checkpoint of step 4
    for s in range(5, 12):
        resumed.write({"step": s, "loss": 20.0 + s, "finite": s != 7, "time": 2.0})
    resumed.close()
    acc = tensorboard(tb)
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(12))  # each step once: the rest purged
    want = {s: 10.0 + s if s < 5 else 20.0 + s for s in range(12)}
    assert last_per_step(acc, "train/loss") == want
    assert last_per_step(acc, "train/skipped") == {s: float(s == 7) for s in range(12)}
    assert last_per_step(acc, "checkpoint/blocked_s") == {4: 0.5}
    assert "train/mfu" not in acc.Tags()["scalars"]  # None: no peak known, nothing written


def test_metrics_log_stamps_records_and_feeds_tensorboard(tmp_path):
    log = MetricsLog(
        tmp_path / "metrics.jsonl", TensorBoardLog(tmp_path / "tb"), stamp=lambda: {"x": 1}
    )
    log.write({"step": 0, "loss": 2.5, "eval_loss": 3.0})
    log.close()
    (rec,) = read_metrics(tmp_path / "metrics.jsonl")
    assert rec["x"] == 1 and "time" in rec
    acc = tensorboard(tmp_path / "tb")
    assert last_per_step(acc, "eval/loss") == {0: 3.0}


# --- slow: a real run, killed twice with kill -9, resumed twice ---


def _wait(cond, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the run did not get there in time"
        time.sleep(0.02)


def _since_last_attempt(run_dir: pathlib.Path) -> list[dict]:
    records = read_metrics(run_dir / "metrics.jsonl")
    starts = [i for i, r in enumerate(records) if "attempt" in r]
    return [r for r in records[starts[-1] :] if "loss" in r] if starts else []


def _kill_after(run_dir: pathlib.Path, past_step: int) -> str:
    """Starts an attempt; kill -9 once it has logged a step past `past_step`."""
    p = cli_popen(*ARGS, "--run-dir", str(run_dir), merge_output=False)
    _wait(lambda: any(r["step"] > past_step for r in _since_last_attempt(run_dir)), 120)
    p.send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, err
    return err


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("killed-twice")
    t0 = time.time()
    errs = [_kill_after(run_dir, 4)]
    logged = max(r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r)
    errs.append(_kill_after(run_dir, logged + 3))  # past the steps it recomputes
    p = cli(*ARGS, "--run-dir", str(run_dir))
    assert p.returncode == 0, p.stderr
    errs.append(p.stderr)
    return {"run_dir": run_dir, "errs": errs, "t0": t0, "t1": time.time()}


@pytest.mark.slow
def test_tensorboard_reader_agrees_with_metrics_after_kill9_and_resume(killed_twice):
    run_dir = killed_twice["run_dir"]
    records = read_metrics(run_dir / "metrics.jsonl")
    latest = latest_per_step(records)
    assert sorted(latest) == list(range(STEPS))
    acc = tensorboard(run_dir / "tb")
    assert len(list((run_dir / "tb").iterdir())) == 3  # one event file per attempt
    for field in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s"):
        tag = f"train/{field}"
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(set(steps)), f"{tag}: a step twice, orphans not purged"
        got = last_per_step(acc, tag)
        assert sorted(got) == sorted(latest), tag
        # TensorBoard keeps float32. The step times differ between attempts: the check that
        # TensorBoard shows the recomputed value, not the killed attempt's.
        want = {s: float(np.float32(r[field])) for s, r in latest.items()}
        assert got == want, tag
    saves = {r["step"]: float(np.float32(r["blocked_s"])) for r in records if "blocked_s" in r}
    assert last_per_step(acc, "checkpoint/blocked_s") == saves
    assert set(last_per_step(acc, "train/skipped").values()) == {0.0}


@pytest.mark.slow
def test_goodput_adds_up_over_two_kill9_and_their_resumes(killed_twice):
    run_dir, errs = killed_twice["run_dir"], killed_twice["errs"]
    rep = read_report(run_dir)
    rows = rep["attempts"]
    assert len(rows) == 3 and [r["finished"] for r in rows] == [False, False, True]
    records = read_metrics(run_dir / "metrics.jsonl")
    # The wall-clock measured apart: from just before the first process started (this test's
    # clock) to the run's last record (its own clock, not the ledger's sums).
    wall = records[-1]["time"] - killed_twice["t0"]
    assert rep["wall_s"] == pytest.approx(wall, rel=0.01)
    assert all(v >= 0 for r in rows for v in r["parts_s"].values()), rows
    # Each attempt's parts cover it up to its last record, the gap after it up to the next.
    attempt_at = [i for i, r in enumerate(records) if "attempt" in r]
    bounds = [*attempt_at, len(records)]
    for row, i, j in zip(rows, bounds, bounds[1:], strict=False):
        assert row["end"] == pytest.approx(records[j - 1]["time"], abs=0.05)
        assert row["process_start"] <= records[i]["time"]
    assert rows[0]["parts_s"]["between"] > 0 and rows[1]["parts_s"]["between"] > 0
    for part in ("startup", "restore", "compile", "productive", "data", "checkpoint"):
        assert rep["parts_s"][part] > 0, part
    # The steps redone are those the loop said it recomputes, counted by the ledger.
    redone = 0
    for row, err in zip(rows[1:], errs[1:], strict=True):
        m = re.search(r"at step (\d+); steps (\d+)\.\.(\d+) are recomputed", " ".join(err.split()))
        assert m, err
        first, last = int(m.group(2)), int(m.group(3))
        assert row["recompute"] == [first, last] and row["first_step"] == int(m.group(1))
        assert row["steps"]["recomputed"] == last - first + 1
        # And the log holds exactly those steps twice: from earlier attempts, and this one's.
        k = row["attempt"] - 1
        before = {r["step"] for r in records[: bounds[k]] if "loss" in r}
        here = {r["step"] for r in records[bounds[k] : bounds[k + 1]] if "loss" in r}
        assert before & here == set(range(first, last + 1))
        redone += last - first + 1
    assert rep["recomputed_steps"] == redone > 0 and rep["parts_s"]["recomputed"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["goodput"]["attempts"] == 3
    assert summary["goodput"]["goodput"] == pytest.approx(rep["goodput"])
    assert 0 < rep["goodput"] < 1


def _goodput(capsys, *args: str) -> tuple[int, str, str]:
    """`jaxdist goodput *args` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main(["goodput", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_goodput_command_json_and_plot(killed_twice, tmp_path, capsys):
    run_dir = str(killed_twice["run_dir"])
    rc, out, err = _goodput(capsys, run_dir, "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got == json.loads(json.dumps(read_report(killed_twice["run_dir"])))
    assert set(got["parts_s"]) == set(ALL_PARTS)
    png = tmp_path / "goodput.png"
    rc, out, err = _goodput(capsys, run_dir, "--plot", str(png))
    assert rc == 0, err
    assert "goodput" in out and "between" in out and "attempt 3" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = _goodput(capsys, str(tmp_path))
    assert rc == 2 and "metrics.jsonl does not exist" in err


def test_an_attempt_a_signal_stopped_is_not_labelled_finished():
    # Ctrl-C saves and ends the attempt with its "end" record, as a run's last step does: the
    # record names the signal, and the report says the attempt was stopped, not finished.
    def attempt(start, first, end):
        said = {"process_start": start, "first_step": first, "recompute": None}
        parts = dict.fromkeys(PARTS, 1.0)
        return [{"step": first, "loss": 1.0, "goodput_s": parts, "attempt": said}, end]

    stopped = {"event": "end", "stopped": "SIGINT", "goodput_s": dict.fromkeys(PARTS, 1.0)}
    ended = {"event": "end", "goodput_s": dict.fromkeys(PARTS, 1.0)}
    rep = report(attempt(100.0, 0, stopped) + attempt(110.0, 5, ended))
    first, second = rep["attempts"]
    assert (first["finished"], first["stopped"]) == (False, "SIGINT")
    assert (second["finished"], second["stopped"]) == (True, None)
    console = Console(record=True, width=200)
    print_report(rep, console)
    (ended_row,) = [line for line in console.export_text().splitlines() if "ended" in line]
    assert ended_row.split("│")[2:4] == [" stopped (SIGINT) ", "  finished "]
