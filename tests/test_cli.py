"""The command line, as a user runs it: outputs on success, one clear line on bad input."""

import json
import math
import re

import pytest

from tests.helpers import cli


def test_train_writes_config_metrics_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    r = cli(
        "train",
        "--model",
        "tiny",
        "--mesh",
        "data=2,fsdp=2,tensor=2",
        "--devices",
        "cpu:8",
        "--steps",
        "6",
        "--batch-size",
        "16",
        "--seed",
        "0",
        "--log-every",
        "1",
        "--run-dir",
        str(run_dir),
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [x for x in lines if "event" not in x]  # checkpoint-interval and profile events
    assert [x["step"] for x in lines] == list(range(6))
    for rec in lines:
        assert {"step", "loss", "step_time_s", "tokens_per_s", "grad_norm", "mfu"} <= set(rec)
        # 16 rows of 128 tokens a step, whatever the step took.
        assert rec["tokens_per_s"] * rec["step_time_s"] == pytest.approx(16 * 128)
        assert math.isfinite(rec["loss"])
    # Untrained, the model guesses near uniformly over the 256 byte values.
    assert lines[0]["loss"] == pytest.approx(math.log(256), abs=0.25)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["mesh"] == {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert config["model"]["name"] == "tiny" and config["devices"]["count"] == 8
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["step_time_s"]["n"] == 4
    assert "loss" in r.stderr and "p50" in r.stderr


def test_comm_json():
    r = cli("comm", "--model", "tiny", "--mesh", "fsdp=8", "--devices", "cpu:8", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert {"axis", "kind", "count", "bytes", "expected_bytes", "ratio"} <= set(rows[0])
    gathers = [x for x in rows if x["axis"] == "fsdp" and x["kind"] == "all-gather"]
    assert gathers and abs(gathers[0]["ratio"] - 1) < 0.05


@pytest.mark.slow
def test_compile_only_reports_memory_for_1b_on_8_devices():
    r = cli(
        "train",
        "--model",
        "1b",
        "--mesh",
        "fsdp=8",
        "--devices",
        "cpu:8",
        "--batch-size",
        "8",
        "--compile-only",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["params"] == 1_015_681_024
    # fp32 params + two Adam moments, split 8 ways: the arguments XLA holds per device.
    state_bytes = 3 * 4 * report["params"] / 8
    assert report["per_device_bytes"]["argument"] == pytest.approx(state_bytes, rel=0.01)
    assert report["per_device_bytes"]["peak_estimate"] > state_bytes


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "data=4"], "needs 4 devices but 8 are present"),
        (["--mesh", "dta=8"], "unknown mesh axis 'dta'"),
        (["--mesh", "cpu9"], "unknown mesh 'cpu9'"),
        (["--model", "huge"], "unknown model 'huge'"),
        (["--mesh", "data=8", "--batch-size", "12"], "does not split over the 8 devices"),
        (["--batch-size", "16", "--microbatches", "3"], "not divisible by 3 microbatches"),
        (["--mesh", "tensor=8"], "dimension '(kv_)?heads' of size 4 is not divisible"),
        (["--data", "/nonexistent/corpus.txt"], "does not exist"),
        (["--devices", "gpu:2"], "--devices 'gpu:2' is not understood"),
        (["--steps", "0"], "--steps 0 must be at least 1"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    defaults = ["--steps", "2", "--run-dir", str(tmp_path / "run")]
    if "--devices" not in args:
        defaults += ["--devices", "cpu:8"]
    r = cli("train", *defaults, *args, timeout=120)
    assert r.returncode != 0
    assert not (tmp_path / "run").exists()  # refused before any output was written
    assert "Traceback" not in r.stderr, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("jaxdist: error:")]
    assert len(errors) == 1, r.stderr
    assert re.search(message, errors[0]), errors[0]


@pytest.mark.slow
def test_bench_prints_one_json_line_with_the_figures():
    r = cli("bench", "--model", "tiny", "--devices", "cpu:8", "--mesh", "fsdp=8", "--steps", "5")
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.strip()]
    out = json.loads(line)
    for key in (
        "model",
        "batch_size",
        "seq_len",
        "tokens_per_s",
        "model_tflops",
        "mfu",
        "step_ms_p50",
        "step_ms_p90",
        "peak_mem_gb",
        "compile_s",
        "loop_overhead",
    ):
        assert key in out, key
    assert out["step_ms_p90"] >= out["step_ms_p50"] > 0
    # 16 rows of 128 tokens in the median step.
    assert out["tokens_per_s"] * out["step_ms_p50"] / 1e3 == pytest.approx(16 * 128)
    # MFU follows from the FLOPs formula, tokens/s x (6N + 12LDT) over 8 devices x 989 TFLOP/s,
    # with tiny's N counted here by hand: 2 layers of attention (4 D^2) and MLP (2 D F) and the
    # head (D V), for D = 128, F = 512, V = 256, T = 128.
    n = 2 * (4 * 128 * 128 + 2 * 128 * 512) + 128 * 256
    flops = 6 * n + 12 * 2 * 128 * 128  # 2,949,120 per token
    assert out["model_tflops"] == pytest.approx(out["tokens_per_s"] * flops / 1e12, rel=1e-6)
    assert out["mfu"] == pytest.approx(out["tokens_per_s"] * flops / (8 * 989e12), rel=1e-6)
