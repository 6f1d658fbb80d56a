"""Checkpoints: restore onto other meshes, damaged checkpoints, non-finite steps, Young-Daly."""

import json
import math
import pathlib

import jax
import numpy as np
import pytest
from rich.console import Console

from jaxdist.checkpoint.interval import CheckpointConfig, Interval, daly_interval_s
from jaxdist.checkpoint.recovery import TrainingStopped
from jaxdist.checkpoint.store import Checkpointer, list_checkpoints, param_shapes
from jaxdist.data import DataConfig, TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.metrics.records import latest_per_step, read_metrics
from jaxdist.optim import OptimConfig
from jaxdist.step import StepConfig
from jaxdist.train import LoopConfig, RunConfig, fit
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config, model_spec
from tests.helpers import compiled_for, mesh_for


def _steps(jitted, state, data, first, last):
    losses = []
    for s in range(first, last):
        state, m = jitted.step_fn(state, jax.device_put(data.batch(s), jitted.batch_sharding))
        losses.append(float(m["loss"]))
    return state, losses


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


@pytest.mark.parametrize(
    "src, dst",
    [
        pytest.param("data=2,fsdp=2,tensor=2", "fsdp=8", marks=pytest.mark.slow),
        pytest.param("data=2,fsdp=2,tensor=2", "single", marks=pytest.mark.slow),
        ("single", "data=2,fsdp=2,tensor=2"),
    ],
)
def test_restore_onto_another_mesh_continues_the_run(tmp_path, src, dst):
    mc, _, a = compiled_for(src, steps=6)
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    state, _ = _steps(a, a.init_fn(), data, 0, 3)
    saved = _leaves(state)
    ck = Checkpointer(tmp_path)
    ck.save(2, state, {"param_shapes": param_shapes(a.abstract_state.params), "mesh": {}})
    _, ref = _steps(a, state, data, 3, 6)  # the uninterrupted run
    ck.close()

    _, mesh_b, b = compiled_for(dst, steps=6)
    restored = Checkpointer(tmp_path).restore_latest(
        b.abstract_state, param_shapes(b.abstract_state.params)
    )
    assert restored.step == 2 and int(restored.state.step) == 3
    for x, y in zip(_leaves(restored.state), saved, strict=True):
        np.testing.assert_array_equal(x, y)  # resharding moves bytes, never changes them
    some = restored.state.params["w_up_LDF"][...]
    assert some.sharding.mesh.shape == mesh_b.shape
    _, losses = _steps(b, restored.state, data, 3, 6)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def _saved_run(tmp_path, steps=(1, 3)):
    mc, _, c = compiled_for("data=8", steps=6)
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    ck = Checkpointer(tmp_path, keep=5)
    shapes = param_shapes(c.abstract_state.params)
    state = c.init_fn()
    for s in range(max(steps) + 1):
        state, _ = _steps(c, state, data, s, s + 1)
        if s in steps:
            ck.save(s, state, {"param_shapes": shapes, "mesh": {"data": 8}})
    ck.close()
    return c, shapes


def test_truncated_latest_checkpoint_falls_back_and_is_kept(tmp_path):
    c, shapes = _saved_run(tmp_path)
    files = [f for f in (tmp_path / "3" / "state").rglob("*") if f.is_file()]
    biggest = max(files, key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    restored = Checkpointer(tmp_path, keep=5).restore_latest(c.abstract_state, shapes)
    assert restored.step == 1
    assert (tmp_path / "3.damaged").is_dir() and (tmp_path / "1").is_dir()
    rows = {r["name"]: r for r in list_checkpoints(tmp_path)}
    assert rows["1"]["valid"] and not rows["3.damaged"]["valid"]


@pytest.mark.slow
def test_checkpoint_whose_contents_changed_is_caught_by_fingerprint(tmp_path):
    c, shapes = _saved_run(tmp_path)
    meta_path = tmp_path / "3" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["fingerprint"][0] += 1.0  # as if one array were altered after the fact
    meta_path.write_text(json.dumps(meta))
    restored = Checkpointer(tmp_path, keep=5).restore_latest(c.abstract_state, shapes)
    assert restored.step == 1 and (tmp_path / "3.damaged").is_dir()


@pytest.mark.slow
def test_incompatible_checkpoint_is_refused_with_its_files_kept(tmp_path):
    _, shapes = _saved_run(tmp_path)
    _, _, other = compiled_for("data=8", "tiny-llama")
    with pytest.raises(ConfigError, match="other parameter shapes"):
        Checkpointer(tmp_path).restore_latest(
            other.abstract_state, param_shapes(other.abstract_state.params)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "3"]


def test_nonfinite_state_is_never_committed(tmp_path):
    _, _, c = compiled_for("data=8")
    state = c.init_fn()
    bad = state._replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
    ck = Checkpointer(tmp_path)
    ck.save(0, bad, {})
    assert ck.wait() is False  # the commit refused it
    ck.save(1, state, {})
    assert ck.wait() is True
    assert ck.steps() == [1]
    assert [r["name"] for r in list_checkpoints(tmp_path) if r["valid"]] == ["1"]


def _run(tmp_path, nonfinite="skip", fault=(), every="2", steps=8):
    mc = get_model_config("tiny")
    return fit(
        model_spec(mc),
        mesh_for("data=8"),
        STANDARD_RULES,
        RunConfig(
            optim=OptimConfig(warmup_steps=2),
            data=DataConfig(batch_size=16),
            step=StepConfig(fault_nan_steps=fault),
            loop=LoopConfig(steps=steps, log_every=1, run_dir=str(tmp_path), nonfinite=nonfinite),
            checkpoint=CheckpointConfig(every=every, keep=10),
        ),
        console=Console(quiet=True),
    )


def _all_checkpoints_finite(tmp_path):
    _, _, c = compiled_for("data=8")
    ck = Checkpointer(tmp_path / "checkpoints", keep=10)
    for step in ck.steps():
        restored = ck._manager.restore(step)  # noqa: SLF001 - raw read of every saved step
        leaves = jax.tree.leaves(restored["state"])
        assert all(np.all(np.isfinite(np.asarray(x))) for x in leaves), step
    return ck.steps()


def test_nan_step_is_skipped(tmp_path):
    summary = _run(tmp_path, "skip", fault=(3,))
    assert summary["skipped_steps"] == [3]
    recs = latest_per_step(read_metrics(tmp_path / "metrics.jsonl"))
    assert math.isnan(recs[3]["loss"]) and all(math.isfinite(recs[s]["loss"]) for s in (4, 7))
    assert _all_checkpoints_finite(tmp_path) == [1, 3, 5, 7]


@pytest.mark.slow
def test_nan_step_stops_with_checkpoints_kept(tmp_path):
    with pytest.raises(TrainingStopped, match="step 4: loss or gradient is NaN"):
        _run(tmp_path, "stop", fault=(4,))
    # The saves before the bad step (every 2: steps 1 and 3) are committed; none after it.
    assert _all_checkpoints_finite(tmp_path) == [1, 3]


@pytest.mark.slow
def test_nan_step_rolls_back_and_skips_past_the_batch(tmp_path):
    summary = _run(tmp_path, "rollback", fault=(4,), steps=10)
    recs = latest_per_step(read_metrics(tmp_path / "metrics.jsonl"))
    assert math.isnan(recs[4]["loss"])
    # Rolled back to the checkpoint of step 3 (state at 4 batches), skipped batch 4, and the
    # step in flight (5) was discarded and rerun from the restored state.
    assert 5 in recs and math.isfinite(recs[5]["loss"])
    assert sorted(recs) == list(range(10))  # and the run went on to its end
    assert summary["final_loss"] == recs[9]["loss"] and math.isfinite(recs[9]["loss"])
    _all_checkpoints_finite(tmp_path)


def test_daly_matches_the_paper_and_auto_interval_adapts():
    dump = 300.0  # Daly (2006) worked example: 5-minute dumps
    for mtbf_h, want_min in ((24, 116.7), (6, 56.7), (0.25, 9.1)):
        assert daly_interval_s(dump, mtbf_h * 3600) / 60 == pytest.approx(want_min, abs=0.1)
    iv = Interval(CheckpointConfig(every="auto", mtbf_hours_per_device=8.0), num_devices=8)
    assert iv.due(0)  # nothing measured yet: save once to learn the cost
    iv.observe(0, blocked_s=2.0, step_time_s=0.1)  # first save pays setup; not used later
    chosen = iv.observe(10, blocked_s=0.5, step_time_s=0.1)
    # system MTBF = 8 h / 8 devices = 3600 s; tau ~ sqrt(2 * 0.5 * 3600) = 60 s = ~600 steps
    assert chosen["mtbf_system_s"] == 3600 and 580 <= chosen["interval_steps"] <= 620
    assert not iv.due(10 + chosen["interval_steps"] - 1) and iv.due(10 + chosen["interval_steps"])


@pytest.mark.slow
def test_auto_interval_is_logged_with_its_inputs(tmp_path):
    mc = get_model_config("tiny")
    fit(
        model_spec(mc),
        mesh_for("data=8"),
        STANDARD_RULES,
        RunConfig(
            optim=OptimConfig(),
            data=DataConfig(batch_size=16),
            step=StepConfig(),
            loop=LoopConfig(steps=12, log_every=4, run_dir=str(tmp_path)),
            checkpoint=CheckpointConfig(every="auto", mtbf_hours_per_device=0.05),
        ),
        console=Console(quiet=True),
    )
    records = read_metrics(tmp_path / "metrics.jsonl")
    events = [r for r in records if r.get("event") == "checkpoint_interval"]
    assert events and {"interval_steps", "save_blocked_s", "mtbf_system_s"} <= set(events[0])
    saves = [r for r in records if r.get("event") == "save"]
    assert saves and all(r["blocked_s"] > 0 for r in saves) and saves[-1]["step"] == 11
    assert pathlib.Path(tmp_path / "checkpoints" / "11").is_dir()  # the final step is saved
