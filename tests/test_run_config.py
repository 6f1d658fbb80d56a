"""Runs you can trust: config files with flags on top, replay from config.json, every knob a
flag checked before anything compiles, and resumes that keep the model and the data stream."""

import contextlib
import io
import json

import pytest
from helpers import losses

from jaxdist.cli.cmd_train import Train
from jaxdist.cli.config_file import build, read
from jaxdist.cli.main import main
from jaxdist.config import OptimConfig
from jaxdist.errors import ConfigError

SMALL = ["--devices", "cpu:8", "--compile-cache", "off"]


def _main(argv: list[str]) -> tuple[int, str]:
    """`jaxdist *argv` in this process: its exit code and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


def _metrics(run_dir) -> str:
    return (run_dir / "metrics.jsonl").read_text()


@pytest.fixture(scope="module")
def reruns(tmp_path_factory):
    """One run and what a user does with it afterwards, in order, each command run once for
    the three tests below (a run of its own each cost a compile, an init and a save): a run
    from a config file with a flag on top; its config.json replayed by --config alone (a new
    run in runs/<time> under the working directory); the replay pointed at the finished run;
    a resume with another batch size and seed; a resume with more steps and another learning
    rate. What each step leaves is read as it happens."""
    tmp = tmp_path_factory.mktemp("reruns")
    (tmp / "run.yaml").write_text(
        "model: tiny-llama\nmesh: data=2,fsdp=2,tensor=2\nbatch_size: 8\n"
        "loop: {steps: 3, log_every: 1, seed: 3}\n"
        "optim: {learning_rate: 0.002, schedule: linear, b2: 0.99, eps: 1.0e-6}\n"
    )
    first = tmp / "first"
    out = {"first": first}
    record = first / "config.json"
    argv = ["train", "--config", str(tmp / "run.yaml"), "--warmup-steps", "1"]
    assert _main([*argv, "--run-dir", str(first), *SMALL])[0] == 0
    out["record"], out["metrics"] = json.loads(record.read_text()), _metrics(first)
    out["losses"] = losses(first)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)  # where runs/<time> goes
        out["replay_rc"], out["replay_err"] = _main(["train", "--config", str(record)])
    (out["replay"],) = (tmp / "runs").iterdir()
    out["replay_losses"], out["metrics_after_replay"] = losses(out["replay"]), _metrics(first)
    again = ["train", "--config", str(record), "--run-dir", str(first)]
    out["finished"] = _main(again)
    out["metrics_after_finished"] = _metrics(first)
    out["attempts_after_finished"] = len(list((first / "attempts").glob("*.json")))
    # Finished, and rerun with another model: refused as such, not "train further" (which
    # would fail on the model).
    out["finished_changed"] = _main([*again, "--d-model", "64"])
    out["refused"] = _main([*again, "--batch-size", "16", "--seed", "1", "--steps", "4"])
    out["record_after_refusal"] = json.loads(record.read_text())
    out["resumed"] = _main([*again, "--steps", "4", "--lr", "0.001"])
    out["losses_after_resume"] = losses(first)
    attempts = sorted((first / "attempts").glob("*.json"))
    out["attempt_steps"] = [json.loads(a.read_text())["loop"]["steps"] for a in attempts]
    return out


@pytest.mark.slow
def test_a_replayed_config_json_gives_bitwise_the_same_losses(reruns):
    record = reruns["record"]
    # The file, and the flag given on top of it.
    assert record["cli"]["optim"]["warmup_steps"] == 1 and record["optim"]["eps"] == 1e-6
    assert record["cli"]["loop"]["seed"] == 3 and record["model"]["name"] == "tiny-llama"
    assert reruns["replay_rc"] == 0, reruns["replay_err"]
    assert reruns["replay_losses"] == reruns["losses"] and len(reruns["losses"]) == 3


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
def test_bad_flags_end_in_one_message_before_anything_runs(flags, message, capsys, monkeypatch):
    def compiled(*args, **kwargs):
        raise AssertionError("a step was built before the flag was refused")

    monkeypatch.setattr("jaxdist.train.build", compiled)
    # In-process: a traceback would escape main() as an exception, not as exit code 2.
    assert main(["train", *flags, *SMALL]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("jaxdist: error: ") and message in line


@pytest.mark.slow
def test_a_custom_model_from_flags_trains(tmp_path):
    argv = ["train", "--model", "custom", "--style", "llama", "--layers", "2", "--d-model", "64"]
    argv += ["--heads", "4", "--kv-heads", "2", "--d-mlp", "128", "--seq-len", "32"]
    argv += ["--vocab", "256", "--steps", "2", "--weight-decay", "0.05", "--b1", "0.8"]
    argv += ["--schedule", "constant", "--min-lr-ratio", "0.5", "--run-dir", str(tmp_path)]
    assert main([*argv, *SMALL]) == 0
    model = json.loads((tmp_path / "config.json").read_text())["model"]
    assert (model["name"], model["num_layers"], model["d_model"], model["num_kv_heads"]) == (
        "custom",
        2,
        64,
        2,
    )


@pytest.mark.slow
def test_a_resume_with_another_batch_size_and_seed_is_refused_naming_both(reruns):
    rc, err = reruns["refused"]
    assert rc == 2, err
    (line,) = err.splitlines()
    # By their flags (the record's data.seed and loop.seed are both --seed's: named once).
    assert "--batch-size 8 -> 16" in line and line.count("--seed 3 -> 1") == 1
    assert "--run-dir" in line
    # Refused before anything was written: the record still says what made the checkpoint.
    assert reruns["record_after_refusal"]["data"]["batch_size"] == 8
    # What may change does, and is logged; every attempt's configuration is kept.
    rc, err = reruns["resumed"]
    assert rc == 0, err
    err = " ".join(err.split())
    # By their flags too, as the refusal names them (not loop.steps, optim.learning_rate).
    assert "changed on resume:" in err and "--steps 3 -> 4" in err
    assert "--lr 0.002 -> 0.001" in err and "loop.steps" not in err
    assert reruns["attempt_steps"] == [3, 4]


@pytest.mark.slow
def test_a_replay_is_a_new_run_and_a_finished_run_says_so_in_one_line(reruns):
    first, replay = reruns["first"], reruns["replay"]
    # --config alone: a new run of the recorded config, in a directory of its own, named.
    assert f"run dir runs/{replay.name}" in " ".join(reruns["replay_err"].split())
    assert reruns["metrics_after_replay"] == reruns["metrics"]  # the recorded run is untouched
    # --run-dir beside --config: that directory, as usual; finished, it says so and stops.
    rc, err = reruns["finished"]
    assert rc == 0 and err.splitlines() == [
        f"run {first} already finished step 2; pass --steps N (N > 3) to train further"
    ]
    rc, err = reruns["finished_changed"]
    err = " ".join(err.split())
    assert rc == 2 and "another model" in err and "--d-model 128 -> 64" in err, err
    assert "already finished" not in err
    assert reruns["metrics_after_finished"] == reruns["metrics"]
    assert reruns["attempts_after_finished"] == 1  # nothing written
    # What it says to do trains further: the run resumes at step 3.
    assert "at step 3" in " ".join(reruns["resumed"][1].split())
    assert sorted(reruns["losses_after_resume"]) == [0, 1, 2, 3]


def test_a_finished_run_says_how_to_train_further_in_its_callers_terms(tmp_path):
    from rich.console import Console

    from jaxdist.train import _finished

    said = {}
    for command in (True, False):
        console = Console(record=True, width=300)
        _finished(tmp_path, 2, console, command=command)
        said[command] = console.export_text()
    assert "pass --steps N (N > 3)" in said[True]
    # fit's Python caller gives no flags: it is told of fit's own arguments.
    assert "--" not in said[False] and "LoopConfig(steps=N) (N > 3)" in said[False]
