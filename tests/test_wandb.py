"""Weights & Biases: the scalars TensorBoard gets, offline without an API key, one W&B run over
the attempts of a resumed run; and a one-line refusal where the extra is not installed.

The offline run is read back from the file wandb writes (RUN_DIR/wandb/offline-run-*/
run-<id>.wandb): LevelDB-style log records (wandb's own format, which its current package
has no public reader for) holding its protobuf Records."""

import importlib.util
import json
import struct
import subprocess
import sys

import pytest

from jaxdist.cli.main import main
from jaxdist.metrics.records import read_metrics
from tests.helpers import CLI_ENV

EXTRA = "needs the wandb extra: pip install 'jaxdist[wandb]'"
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason=EXTRA)
# tiny on the default mesh at batch 16, as the other tests' short runs: one step program for
# the session (read back from its compile cache); --compile-cache off leaves that cache alone.
TRAIN = ["train", "--model", "tiny", "--batch-size", "16", "--log-every", "1"]
TRAIN += ["--checkpoint-every", "2", "--devices", "cpu:8", "--wandb", "jaxdist-test"]
TRAIN += ["--compile-cache", "off"]


def _records(path) -> list[bytes]:
    """The payloads of a .wandb file: a 7-byte header (":W&B", a 2-byte magic, a version),
    then 32 KiB blocks of chunks, each with a 7-byte header (CRC, length, type: 1 whole,
    2 first, 3 middle, 4 last); a block's tail too short for a header is padding."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    out, pos, partial = [], 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeros: the rest of the block is unused
            pos += left
            continue
        partial += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(partial)
            partial = b""
    return out


def _history(path) -> tuple[dict[int, dict], set[str]]:
    """Step -> the values logged at it (rows of one step merged), and the run ids recorded."""
    from wandb.proto import wandb_internal_pb2

    rows, ids = {}, set()
    for raw in _records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "run":
            ids.add(rec.run.run_id)
        if rec.WhichOneof("record_type") == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item
            }
            rows.setdefault(row["_step"], {}).update(row)
    return rows, ids


def _check_against_metrics(rows: dict[int, dict], records: list[dict], steps: list[int]):
    train = {r["step"]: r for r in records if "loss" in r and r["step"] in steps}
    saves = {r["step"]: r for r in records if r.get("event") == "save" and r["step"] in steps}
    assert sorted(rows) == steps == sorted(train)
    for s, r in train.items():
        row = rows[s]
        assert row["train/loss"] == r["loss"] and row["train/grad_norm"] == r["grad_norm"]
        assert row["train/lr"] == r["lr"] and row["train/step_time_s"] == r["step_time_s"]
        assert row["train/tokens_per_s"] == r["tokens_per_s"] and row["train/skipped"] == 0
        assert "train/mfu" not in row  # a CPU has no known peak: no MFU, in either
    assert saves and all(
        rows[s]["checkpoint/blocked_s"] == r["blocked_s"] for s, r in saves.items()
    )


@needs_wandb
@pytest.mark.slow
def test_an_offline_run_holds_the_metrics_and_a_resume_continues_it(tmp_path, monkeypatch, capsys):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)
    # No API key anywhere wandb looks: not in a .netrc, not in its settings.
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    run = tmp_path / "run"
    assert main([*TRAIN, "--steps", "3", "--run-dir", str(run)]) == 0
    run_id = (run / "wandb" / "jaxdist-run-id").read_text().strip()
    assert f"W&B run {run_id}: offline in {run / 'wandb'} (no API key)" in capsys.readouterr().err
    (first,) = (run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    rows, ids = _history(first)
    assert ids == {run_id}
    _check_against_metrics(rows, read_metrics(run / "metrics.jsonl"), [0, 1, 2])

    # Resumed (from the checkpoint of step 2): the same W&B run, its steps 3 and 4.
    assert main([*TRAIN, "--steps", "5", "--run-dir", str(run)]) == 0
    fragments = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(fragments) == 2 and fragments[0] == first
    rows, ids = _history(fragments[1])
    assert ids == {run_id}
    _check_against_metrics(rows, read_metrics(run / "metrics.jsonl"), [3, 4])


def test_wandb_without_the_extra_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where it is not installed
    run = tmp_path / "run"
    assert main([*TRAIN, "--steps", "1", "--run-dir", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "jaxdist: error: --wandb needs the wandb package, which is not installed: "
        "pip install 'jaxdist[wandb]'"
    ]
    assert not run.exists()


@pytest.mark.slow  # a fresh interpreter: ~3 s of imports
def test_the_library_does_not_import_wandb_unless_asked():
    code = (
        "import sys, jaxdist.train, jaxdist.metrics.wandb_log, jaxdist.cli.main; "
        "assert 'wandb' not in sys.modules, 'wandb imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], env=CLI_ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
