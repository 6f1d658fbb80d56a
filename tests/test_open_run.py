"""One way to open a trained run (jaxdist.inference.runs.open_run): `eval`, `generate` and
`export-hf` each go through it, none builds an optimizer or a train step, and what it reads
(the weights alone) is what the whole state's restore reads."""

import json

import jax
import numpy as np
import pytest

import jaxdist.optim
import jaxdist.step
from jaxdist.checkpoint.store import restore
from jaxdist.cli.main import main
from jaxdist.inference import runs
from jaxdist.metrics.records import read_metrics
from meshes.presets import STANDARD_RULES
from models.presets import from_record, get_model_config, model_spec
from tests.helpers import mesh_for
from tests.test_token_data import make_data, random_docs

DEVICES = ["--devices", "cpu:8", "--compile-cache", "off"]


def _train(tmp, name: str, *extra: str):
    """A tiny run of 3 steps on tokenized data, evaluated (2 batches) at its last step."""
    data = tmp / "data"
    if not data.exists():
        make_data(tmp, "data", random_docs(200, 0))
    run = tmp / name
    argv = ["train", "--data", str(data), "--model", "tiny", "--seq-len", "32", "--steps", "3"]
    argv += ["--batch-size", "8", "--eval-every", "3", "--eval-batches", "2", *extra]
    assert main([*argv, "--run-dir", str(run), *DEVICES]) == 0
    return run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("open_run"), "run")


@pytest.fixture
def no_step(monkeypatch):
    """Building an optimizer or a train step fails; every open_run call is counted."""

    def refused(*args, **kwargs):
        raise AssertionError("a run opened for use built an optimizer or a train step")

    for module, name in (
        (jaxdist.optim, "make_optimizer"),
        (jaxdist.step, "build"),
        (jaxdist.step, "make_train_step"),
    ):
        monkeypatch.setattr(module, name, refused)
    opened = []
    real = runs.open_run

    def counted(*args, **kwargs):
        opened.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(runs, "open_run", counted)
    return opened


def test_eval_generate_and_export_open_the_run_and_build_no_step(trained, no_step, capsys):
    run = trained
    (last,) = [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    capsys.readouterr()
    assert main(["eval", str(run), "--json", *DEVICES]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The same 2 batches as the run's own evaluation of the same weights, on the same mesh.
    assert got["step"] == last["step"] == 2
    np.testing.assert_allclose(got["loss"], last["eval_loss"], rtol=1e-6)
    # Without --json: one line a person reads, the same figures.
    assert main(["eval", str(run), *DEVICES]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"eval {run} step 2: loss {got['loss']:.4f}  perplexity ")
    assert f"over {got['tokens']:,} tokens" in line and "{" not in line

    argv = ["generate", str(run), "--prompt", "abc", "--max-new-tokens", "3", "--json"]
    assert main([*argv, *DEVICES]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_ids"]) <= 3

    out = run.parent / "hf"
    assert main(["export-hf", str(run), str(out), "--mesh", "fsdp=8", *DEVICES]) == 0
    assert (out / "model.safetensors").is_file()
    assert no_step == [run, run, run, run]


def _weights_alike(run, mesh: str = "data=2,fsdp=2,tensor=2", opened_on: str | None = None):
    """open_run's weights (on `opened_on`, default `mesh`) against the whole state's restore
    on `mesh`, for which the step is built; a replica run's are its outer weights."""
    from jaxdist.config import OptimConfig
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.optim import make_optimizer
    from jaxdist.parallel import replica

    record = runs.read_record(run)
    spec = model_spec(from_record(record["model"]))
    built_on = mesh_for(mesh)
    opened = runs.open_run(run, spec, mesh_for(opened_on or mesh), STANDARD_RULES)
    tx, lr = make_optimizer(OptimConfig(**record["optim"]), record["loop"]["steps"])
    step = StepConfig(**StepConfig.recorded_state(record["step"]))
    sync = replica.recorded(record, built_on.shape, run)
    layout = Layout.on(
        built_on, STANDARD_RULES, step, batch_size=8, seq_len=spec.seq_len, sync=sync
    )
    jitted = jaxdist.step.build(spec.init, tx, lr, layout, built_on)
    whole = restore(run, jitted.abstract_state)
    assert opened.step == whole.step
    weights = whole.state.params if sync is None else whole.state.outer.params
    pairs = zip(jax.tree.leaves(opened.params), jax.tree.leaves(weights), strict=True)
    for a, b in pairs:
        assert opened_on or a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_weights_read_alone_are_the_whole_states(trained):
    _weights_alike(trained)


@pytest.mark.slow
def test_an_fp8_delayed_runs_weights_read_alone(tmp_path):
    # Its state holds FP8 scales and histories after the optimizer's: left unread.
    _weights_alike(_train(tmp_path, "fp8", "--fp8", "delayed"))


@pytest.mark.slow
def test_a_replica_runs_outer_weights_read_alone_on_any_mesh(tmp_path):
    # Its state holds each group's weights and optimizer state, then the outer state: its
    # outer weights are the model, read on a mesh without groups.
    mesh = "replica=2,fsdp=4"
    run = _train(tmp_path, "replica", "--mesh", mesh, "--sync-every", "2")
    _weights_alike(run, mesh, opened_on="fsdp=8")


def test_what_is_not_a_trained_run_is_one_line(tmp_path):
    from jaxdist.errors import ConfigError

    spec = model_spec(get_model_config("tiny"))
    mesh = mesh_for("data=2,fsdp=2,tensor=2")
    with pytest.raises(ConfigError, match="config.json is missing or unreadable"):
        runs.open_run(tmp_path / "nothing", spec, mesh, STANDARD_RULES)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="holds no checkpoint; train it first"):
        runs.open_run(tmp_path, spec, mesh, STANDARD_RULES)
