"""Runs you can trust: config files with flags on top, replay from config.json, every knob a
flag checked before anything compiles, and resumes that keep the model and the data stream."""

import json

import pytest
from helpers import cli, losses, mesh_for
from rich.console import Console

from jaxdist.cli.cmd_train import Train
from jaxdist.cli.config_file import build, read
from jaxdist.cli.main import main
from jaxdist.data import DataConfig
from jaxdist.errors import ConfigError
from jaxdist.optim import OptimConfig
from jaxdist.step import StepConfig
from jaxdist.train import LoopConfig, RunConfig, fit
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config, model_spec

QUIET = Console(quiet=True)
SMALL = ["--devices", "cpu:8", "--compile-cache", "off"]


@pytest.mark.slow
def test_a_replayed_config_json_gives_bitwise_the_same_losses(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "model: tiny-llama\nmesh: data=2,fsdp=2,tensor=2\nbatch_size: 8\n"
        "loop: {steps: 3, log_every: 1, seed: 3}\n"
        "optim: {learning_rate: 0.002, schedule: linear, b2: 0.99, eps: 1.0e-6}\n"
    )
    first = tmp_path / "first"
    # The file, and a flag on top of it.
    r = cli(
        "train",
        "--config",
        str(tmp_path / "run.yaml"),
        "--warmup-steps",
        "1",
        "--run-dir",
        str(first),
        *SMALL,
    )
    assert r.returncode == 0, r.stderr
    record = json.loads((first / "config.json").read_text())
    assert record["cli"]["optim"]["warmup_steps"] == 1 and record["optim"]["eps"] == 1e-6
    assert record["cli"]["loop"]["seed"] == 3 and record["model"]["name"] == "tiny-llama"
    again = tmp_path / "again"
    r = cli("train", "--config", str(first / "config.json"), "--run-dir", str(again), *SMALL)
    assert r.returncode == 0, r.stderr
    assert losses(again) == losses(first) and len(losses(first)) == 3


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_config_files_of_each_format_build_the_tree(tmp_path, suffix):
    text = {
        ".yaml": "model: tiny\nbatch_size: 8\nloop:\n  steps: 7\nstep: {microbatches: 2}\n",
        ".toml": 'model = "tiny"\nbatch_size = 8\n[loop]\nsteps = 7\n[step]\nmicrobatches = 2\n',
        ".json": '{"model": "tiny", "batch_size": 8, "loop": {"steps": 7}, '
        '"step": {"microbatches": 2}}',
    }[suffix]
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    args = build(Train, read(str(path)))
    assert (args.model, args.batch_size, args.loop.steps, args.step.microbatches) == (
        "tiny",
        8,
        7,
        2,
    )
    assert args.optim == OptimConfig()  # untouched components keep their defaults


@pytest.mark.parametrize(
    "text, message",
    [
        ("loop: {stpes: 3}\n", "did you mean 'steps'"),
        ("optim: {schedule: cosine2}\n", "not one of"),
        ("batch_size: eight\n", "is not a"),
        ("loop: 3\n", "must be a table"),
        ("- a\n- b\n", "table of settings"),
    ],
)
def test_bad_config_files_name_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        build(Train, read(str(path)))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
        (["--batch-size", "-4"], "--batch-size -4 must be at least 1"),
        (["--steps", "0"], "--steps 0 must be at least 1"),
        (["--lr", "0"], "--lr 0.0 must be > 0"),
        (["--eps", "0"], "--eps 0.0 must be > 0"),
        (["--b2", "1.0"], "--b2 1.0 must lie in"),
        (["--clip", "-1"], "--clip -1.0 must be >= 0"),
        (["--microbatches", "0"], "--microbatches 0 must be at least 1"),
        (["--model", "custom", "--style", "llama"], "--model custom needs --layers"),
        (["--model", "nope"], "unknown model 'nope'"),
        (["--eval-batches", "0"], "--eval-batches 0 must be at least 1"),
        (["--checkpoint-every", "0"], "--checkpoint-every 0 must be at least 1"),
        (["--config", "missing.yaml"], "config file missing.yaml does not exist"),
    ],
)
def test_bad_flags_end_in_one_message_before_anything_runs(flags, message):
    r = cli("train", *flags, *SMALL)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_custom_model_from_flags_trains(tmp_path):
    r = cli(
        "train",
        "--model",
        "custom",
        "--style",
        "llama",
        "--layers",
        "2",
        "--d-model",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--d-mlp",
        "128",
        "--seq-len",
        "32",
        "--vocab",
        "256",
        "--steps",
        "2",
        "--weight-decay",
        "0.05",
        "--b1",
        "0.8",
        "--schedule",
        "constant",
        "--min-lr-ratio",
        "0.5",
        "--run-dir",
        str(tmp_path),
        *SMALL,
    )
    assert r.returncode == 0, r.stderr
    model = json.loads((tmp_path / "config.json").read_text())["model"]
    assert (model["name"], model["num_layers"], model["d_model"], model["num_kv_heads"]) == (
        "custom",
        2,
        64,
        2,
    )


def _run(run_dir, steps=2, batch_size=16, seed=0, lr=3e-3):
    model = model_spec(get_model_config("tiny", seq_len=32))
    config = RunConfig(
        OptimConfig(learning_rate=lr, warmup_steps=1),
        DataConfig(batch_size=batch_size, seed=seed),
        StepConfig(),
        LoopConfig(steps=steps, log_every=1, run_dir=str(run_dir), seed=seed),
    )
    console = Console(record=True, width=200, quiet=False, file=open("/dev/null", "w"))  # noqa: SIM115
    fit(model, mesh_for("data=8"), STANDARD_RULES, config, console)
    return console.export_text()


@pytest.mark.slow
def test_a_resume_with_another_batch_size_and_seed_is_refused_naming_both(tmp_path):
    _run(tmp_path, steps=2)
    with pytest.raises(ConfigError) as e:
        _run(tmp_path, steps=4, batch_size=32, seed=1)
    assert "data.batch_size 16 -> 32" in str(e.value) and "data.seed 0 -> 1" in str(e.value)
    assert "--run-dir" in str(e.value)
    # Refused before anything was written: the record still says what made the checkpoint.
    assert json.loads((tmp_path / "config.json").read_text())["data"]["batch_size"] == 16
    # What may change does, and is logged; every attempt's configuration is kept.
    out = _run(tmp_path, steps=4, lr=1e-3)
    assert "changed on resume:" in out and "loop.steps 2 -> 4" in out
    assert "optim.learning_rate 0.003 -> 0.001" in out
    attempts = sorted((tmp_path / "attempts").glob("*.json"))
    assert [json.loads(a.read_text())["loop"]["steps"] for a in attempts] == [2, 4]


TINY = ["--model", "tiny", "--batch-size", "8", "--log-every", "1", "--devices", "cpu:8"]


@pytest.mark.slow
def test_a_replay_is_a_new_run_and_a_finished_run_says_so_in_one_line(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # where runs/<time> goes
    first = tmp_path / "first"
    assert main(["train", *TINY, "--steps", "2", "--run-dir", str(first)]) == 0
    before = (first / "metrics.jsonl").read_text()
    capsys.readouterr()
    # --config alone: a new run of the recorded config, in a directory of its own, named.
    assert main(["train", "--config", str(first / "config.json")]) == 0
    err = capsys.readouterr().err
    (replay,) = (tmp_path / "runs").iterdir()
    assert f"run dir runs/{replay.name}" in " ".join(err.split())
    assert losses(replay) == losses(first) and sorted(losses(first)) == [0, 1]
    assert (first / "metrics.jsonl").read_text() == before  # the recorded run is untouched
    # --run-dir beside --config: that directory, as usual; finished, it says so and stops.
    again = ["train", "--config", str(first / "config.json"), "--run-dir", str(first)]
    assert main(again) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"run {first} already finished step 1; pass --steps N (N > 2) to train further"
    ]
    assert (first / "metrics.jsonl").read_text() == before
    assert len(list((first / "attempts").glob("*.json"))) == 1  # nothing written
    # What it says to do trains further: the run resumes at step 2.
    assert main([*again, "--steps", "3"]) == 0
    assert "at step 2" in " ".join(capsys.readouterr().err.split())
    assert sorted(losses(first)) == [0, 1, 2]
