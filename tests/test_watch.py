"""Watching a run: TensorBoard events read back by TensorBoard's own reader, and goodput
accounting that adds up to the wall-clock over attempts killed with kill -9 and resumed."""

import json
import pathlib
import re
import signal
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxdist.metrics.goodput import ALL_PARTS, PARTS, Ledger, read_report, report
from jaxdist.metrics.records import MetricsLog, latest_per_step, read_metrics
from jaxdist.metrics.tensorboard import TensorBoardLog
from tests.helpers import cli, cli_popen, tiny_train

STEPS = 30
ARGS = [*tiny_train(STEPS, checkpoint_every=5), "--devices", "cpu:8"]


def tensorboard(tb_dir: pathlib.Path) -> EventAccumulator:
    acc = EventAccumulator(str(tb_dir))  # purge_orphaned_data is on, as in TensorBoard
    acc.Reload()
    return acc


def last_per_step(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}  # in read order: the last one wins


# --- fast: the pieces in-process ---


def test_ledger_parts_add_up_to_the_time_since_process_start(tmp_path):
    ledger = Ledger()
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(6))
    )
    ledger.begin(3, tmp_path / "metrics.jsonl")  # resumed at 3; 3..5 were logged
    first = ledger.fields()["attempt"]  # said once, in the attempt's first record
    assert first["recompute"] == [3, 5] and first["first_step"] == 3
    assert "attempt" not in ledger.fields()
    for s in range(3, 9):
        with ledger.part("data"):
            time.sleep(0.002)
        time.sleep(0.003)  # the step
        ledger.step(s)
    with ledger.part("checkpoint"):
        time.sleep(0.01)
    fields = ledger.fields()
    since_start = time.time() - ledger.process_start
    assert sum(fields["goodput_s"].values()) == pytest.approx(since_start, abs=0.005)
    assert fields["goodput_steps"] == {"recomputed": 3, "productive": 3}  # 3..5, 6..8
    parts = fields["goodput_s"]
    assert parts["compile"] > 0 and parts["recomputed"] > 0 and parts["productive"] > 0
    assert parts["data"] >= 6 * 0.002 and parts["checkpoint"] >= 0.01


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
    assert rep["wall_s"] == pytest.approx(18.0) == sum(rep["parts_s"].values())
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
    errs = [_kill_after(run_dir, 7)]
    logged = max(r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r)
    errs.append(_kill_after(run_dir, logged + 4))  # well past the steps it recomputes
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
    assert sum(rep["parts_s"].values()) == pytest.approx(rep["wall_s"], abs=1e-4)
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
        m = re.search(r"at step (\d+); steps (\d+)\.\.(\d+) are recomputed", err)
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


@pytest.mark.slow
def test_goodput_command_json_and_plot(killed_twice, tmp_path):
    run_dir = str(killed_twice["run_dir"])
    r = cli("goodput", run_dir, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got == json.loads(json.dumps(read_report(killed_twice["run_dir"])))
    assert set(got["parts_s"]) == set(ALL_PARTS)
    png = tmp_path / "goodput.png"
    r = cli("goodput", run_dir, "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "goodput" in r.stdout and "between" in r.stdout and "attempt 3" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = cli("goodput", str(tmp_path))
    assert r.returncode == 2 and "metrics.jsonl does not exist" in r.stderr
