"""Checkpoints: restore onto other meshes, damaged checkpoints, non-finite steps, Young-Daly.

Every run on the cpu8 layout here is one compiled program, built once: the tiny model on rows
of 32 tokens, batch 8 (a step of ~0.05 s, not ~0.3 s: nothing here depends on the size), warmup
2 then cosine over 6 steps whatever the run's length, NaN injected at step 6. The restore and
auto-interval runs stop before step 6; the non-finite policy runs meet it."""

import errno
import json
import math
import pathlib
import shutil
from unittest import mock

import jax
import numpy as np
import pytest
from rich.console import Console

from jaxdist.checkpoint.damage import RestoreFailed, list_checkpoints
from jaxdist.checkpoint.interval import CheckpointConfig, Interval, daly_interval_s
from jaxdist.checkpoint.store import Checkpointer, param_shapes
from jaxdist.config import DataConfig, LoopConfig, OptimConfig, RunConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError, TrainingStopped
from jaxdist.layout import Layout, StepConfig
from jaxdist.metrics.records import latest_per_step, read_metrics
from jaxdist.optim import make_optimizer
from jaxdist.step import build
from jaxdist.train import fit
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config, model_spec
from models.transformer import Transformer
from tests.helpers import mesh_for

CPU8 = "data=2,fsdp=2,tensor=2"
NAN_AT = 6
OPTIM = OptimConfig(warmup_steps=2, decay_steps=6)
STEP = StepConfig(fault_nan_steps=(NAN_AT,))
SEQ, BATCH = 32, 8


def compiled(layout: str, model: str = "tiny"):
    """The model config, mesh and jitted step of this file's program on `layout`."""
    mc = get_model_config(model, seq_len=SEQ)
    mesh = mesh_for(layout)
    tx, lr = make_optimizer(OPTIM, NAN_AT)
    init = lambda r: Transformer(mc, r)  # noqa: E731
    layout = Layout.on(mesh, STANDARD_RULES, STEP, batch_size=BATCH, seq_len=SEQ)
    return mc, mesh, build(init, tx, lr, layout, mesh)


def _steps(jitted, state, data, first, last):
    losses = []
    for s in range(first, last):
        state, m = jitted.step_fn(state, jax.device_put(data.batch(s), jitted.batch_sharding))
        losses.append(float(m["loss"]))
    return state, losses


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


# One run hops across meshes, a checkpoint at each hop: written on the cpu8 layout, restored
# onto fsdp=8, written there, restored onto one device, written there, restored onto the cpu8
# layout; each restore is checked against the bytes saved and continues the run.
HOPS = ((CPU8, 3), ("fsdp=8", 4), ("single", 5), (CPU8, 6))


@pytest.mark.slow
def test_restore_onto_another_mesh_continues_the_run(tmp_path):
    src, first = HOPS[0]
    mc, _, a = compiled(src)
    data = TokenBatches(DataConfig(batch_size=BATCH), mc.seq_len, mc.vocab_size)
    state, ref = _steps(a, a.init_fn(), data, 0, first)
    shapes = param_shapes(a.abstract_state.params)
    for (_, done), (dst, until) in zip(HOPS, HOPS[1:], strict=False):
        saved = _leaves(state)
        ck = Checkpointer(tmp_path / str(done))
        ck.save(done - 1, state, {"param_shapes": shapes, "mesh": {}})
        if done == first:
            ref += _steps(a, state, data, first, 6)[1]  # the uninterrupted run
        ck.close()
        _, mesh_b, b = compiled(dst)
        ck = Checkpointer(tmp_path / str(done))
        restored = ck.restore_latest(b.abstract_state, param_shapes(b.abstract_state.params))
        ck.close()
        assert restored.step == done - 1 and int(restored.state.step) == done, dst
        for x, y in zip(_leaves(restored.state), saved, strict=True):
            np.testing.assert_array_equal(x, y)  # resharding moves bytes, never changes them
        some = restored.state.params["w_up_LDF"][...]
        assert some.sharding.mesh.shape == mesh_b.shape
        state, losses = _steps(b, restored.state, data, done, until)
        np.testing.assert_allclose(losses, ref[done:until], rtol=1e-5, err_msg=dst)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Checkpoints of steps 1 and 3: the init state, marked as after 2 and 4 updates (what is
    checked here is the store, not training). Each test damages its own copy."""
    directory = tmp_path_factory.mktemp("saved")
    _, _, c = compiled(CPU8)
    ck = Checkpointer(directory, keep=5)
    shapes = param_shapes(c.abstract_state.params)
    state = c.init_fn()
    for s in (1, 3):
        state = state._replace(step=jax.device_put(np.int32(s + 1), state.step.sharding))
        ck.save(s, state, {"param_shapes": shapes, "mesh": {"data": 2, "fsdp": 2, "tensor": 2}})
    ck.close()
    return directory, c, shapes


def _copy(saved_run, tmp_path):
    shutil.copytree(saved_run[0], tmp_path, dirs_exist_ok=True)
    return saved_run[1:]


def test_truncated_latest_checkpoint_falls_back_and_is_kept(tmp_path, saved_run):
    c, shapes = _copy(saved_run, tmp_path)
    files = [f for f in (tmp_path / "3" / "state").rglob("*") if f.is_file()]
    biggest = max(files, key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    restored = Checkpointer(tmp_path, keep=5).restore_latest(c.abstract_state, shapes)
    assert restored.step == 1 and int(restored.state.step) == 2
    assert (tmp_path / "3.damaged").is_dir() and (tmp_path / "1").is_dir()
    rows = {r["name"]: r for r in list_checkpoints(tmp_path)}
    assert rows["1"]["valid"] and not rows["3.damaged"]["valid"]


def test_a_missing_data_file_is_damage_and_is_set_aside(tmp_path, saved_run):
    c, shapes = _copy(saved_run, tmp_path)
    files = [f for f in (tmp_path / "3" / "state").rglob("*") if f.is_file() and "/d/" in str(f)]
    max(files, key=lambda f: f.stat().st_size).unlink()  # Orbax: "Truncated ... stream"
    restored = Checkpointer(tmp_path, keep=5).restore_latest(c.abstract_state, shapes)
    assert restored.step == 1 and (tmp_path / "3.damaged").is_dir()


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EIO, "Input/output error"),  # a flaky network file system
        OSError(errno.ESTALE, "Stale file handle"),
        PermissionError(errno.EACCES, "Permission denied"),
        MemoryError("out of memory"),
        RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 5.2GiB"),
        ValueError('UNKNOWN: Error reading "a/0" in OCDBT database: Input/output error'),
        ValueError("UNAVAILABLE: DEADLINE_EXCEEDED reading gs://bucket/run/3"),
    ],
    ids=lambda e: type(e).__name__ + ":" + str(e)[:20],
)
def test_a_restore_error_that_shows_no_damage_stops_and_touches_nothing(tmp_path, saved_run, error):
    c, shapes = _copy(saved_run, tmp_path)
    ck = Checkpointer(tmp_path, keep=5)
    with mock.patch.object(ck._manager, "restore", side_effect=error):
        with pytest.raises(RestoreFailed) as stopped:
            ck.restore_latest(c.abstract_state, shapes)
    message = str(stopped.value)
    assert f"checkpoint {tmp_path / '3'} could not be restored ({type(error).__name__}" in message
    assert "left as they are" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "3"]  # nothing set aside
    ck.close()


@pytest.mark.slow
def test_checkpoint_whose_contents_changed_is_caught_by_fingerprint(tmp_path, saved_run):
    c, shapes = _copy(saved_run, tmp_path)
    meta_path = tmp_path / "3" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["fingerprint"][0] += 1.0  # as if one array were altered after the fact
    meta_path.write_text(json.dumps(meta))
    restored = Checkpointer(tmp_path, keep=5).restore_latest(c.abstract_state, shapes)
    assert restored.step == 1 and (tmp_path / "3.damaged").is_dir()


@pytest.mark.slow
def test_incompatible_checkpoint_is_refused_with_its_files_kept(tmp_path, saved_run):
    _copy(saved_run, tmp_path)
    _, _, other = compiled(CPU8, "tiny-llama")  # its shapes only: nothing compiles
    with pytest.raises(ConfigError, match="other parameter shapes"):
        Checkpointer(tmp_path).restore_latest(
            other.abstract_state, param_shapes(other.abstract_state.params)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "3"]


def test_nonfinite_state_is_never_committed(tmp_path):
    _, _, c = compiled(CPU8)
    state = c.init_fn()
    bad = state._replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
    ck = Checkpointer(tmp_path)
    ck.save(0, bad, {})
    assert ck.wait() is False  # the commit refused it
    ck.save(1, state, {})
    assert ck.wait() is True
    assert ck.steps() == [1]
    assert [r["name"] for r in list_checkpoints(tmp_path) if r["valid"]] == ["1"]


def _fit(tmp_path, steps, checkpoint: CheckpointConfig, nonfinite="skip", log_every=1):
    return fit(
        model_spec(get_model_config("tiny", seq_len=SEQ)),
        mesh_for(CPU8),
        STANDARD_RULES,
        RunConfig(
            optim=OPTIM,
            data=DataConfig(batch_size=BATCH),
            step=STEP,
            loop=LoopConfig(steps, log_every, run_dir=str(tmp_path), nonfinite=nonfinite),
            checkpoint=checkpoint,
        ),
        console=Console(quiet=True),
    )


def _all_checkpoints_finite(tmp_path):
    ck = Checkpointer(tmp_path / "checkpoints", keep=10)
    for step in ck.steps():
        restored = ck._manager.restore(step)  # noqa: SLF001 - raw read of every saved step
        leaves = jax.tree.leaves(restored["state"])
        assert all(np.all(np.isfinite(np.asarray(x))) for x in leaves), step
    return ck.steps()


@pytest.mark.slow
def test_nan_step_is_skipped(tmp_path):
    # A save every step: that of the NaN step itself too, written before its NaN is seen.
    summary = _fit(tmp_path, 8, CheckpointConfig(every="1", keep=10), "skip")
    assert summary["skipped_steps"] == [6]
    recs = latest_per_step(read_metrics(tmp_path / "metrics.jsonl"))
    assert math.isnan(recs[6]["loss"]) and all(math.isfinite(recs[s]["loss"]) for s in (5, 7))
    assert _all_checkpoints_finite(tmp_path) == list(range(8))


@pytest.mark.slow
def test_nan_step_stops_with_checkpoints_kept(tmp_path):
    with pytest.raises(TrainingStopped, match="step 6: loss or gradient is NaN"):
        _fit(tmp_path, 8, CheckpointConfig(every="2", keep=10), "stop")
    # The saves before the bad step (every 2: steps 1, 3 and 5) are committed; none after it.
    assert _all_checkpoints_finite(tmp_path) == [1, 3, 5]


@pytest.mark.slow
def test_nan_step_rolls_back_and_skips_past_the_batch(tmp_path):
    summary = _fit(tmp_path, 10, CheckpointConfig(every="2", keep=10), "rollback")
    recs = latest_per_step(read_metrics(tmp_path / "metrics.jsonl"))
    assert math.isnan(recs[6]["loss"])
    # Rolled back to the checkpoint of step 5 (state at 6 batches), skipped batch 6, and the
    # step in flight (7) was discarded and rerun from the restored state.
    assert 7 in recs and math.isfinite(recs[7]["loss"])
    assert sorted(recs) == list(range(10))  # and the run went on to its end
    assert summary["final_loss"] == recs[9]["loss"] and math.isfinite(recs[9]["loss"])
    _all_checkpoints_finite(tmp_path)


def test_daly_matches_the_paper_and_auto_interval_adapts():
    dump = 300.0  # Daly (2006) worked example: 5-minute dumps
    for mtbf_h, want_min in ((24, 116.7), (6, 56.7), (0.25, 9.1)):
        assert daly_interval_s(dump, mtbf_h * 3600) / 60 == pytest.approx(want_min, abs=0.1)
    iv = Interval(CheckpointConfig(every="auto", mtbf_hours_per_device=8.0), num_devices=8)
    # Nothing timed: no save, not even at step 0 to learn its cost.
    assert iv.choose(None) is None and not iv.due(0) and not iv.due(100)
    # Timed, no cost yet: the first save waits the 10-minute cap (the 3600 s MTBF is longer),
    # 6000 steps of 0.1 s; that is no Young-Daly choice, so nothing is returned to log.
    assert iv.choose(0.1) is None and iv.steps == 6000
    assert not iv.due(5998) and iv.due(5999)
    iv.observe(5999, blocked_s=2.0, step_time_s=0.1)  # first save pays setup; not used later
    chosen = iv.observe(6010, blocked_s=0.5, step_time_s=0.1)
    # system MTBF = 8 h / 8 devices = 3600 s; tau ~ sqrt(2 * 0.5 * 3600) = 60 s = ~600 steps,
    # under the cap: kept as it is.
    assert chosen["mtbf_system_s"] == 3600 and 580 <= chosen["interval_steps"] <= 620
    assert chosen["interval_s"] == chosen["young_daly_s"] and chosen["cap_s"] == 600
    assert not iv.due(6010 + chosen["interval_steps"] - 1) and iv.due(
        6010 + chosen["interval_steps"]
    )


def test_auto_interval_is_capped_only_while_the_cap_costs_under_one_percent():
    # One device of the default MTBF (50,000 h): tau for a 0.2 s save is 2.4 h, capped at 10
    # minutes, which costs 0.03%.
    small = Interval(CheckpointConfig(every="auto"), num_devices=1)
    chosen, tau = small.interval_s(0.2)
    assert chosen == 600 and tau == daly_interval_s(0.2, 50_000 * 3600) and tau > 8000
    # A big fleet's slow save (30 s, system MTBF 100 h: tau ~ 1.3 h): the cap would cost 5%;
    # the interval stops where saving costs 1% (3000 s), not at the cap.
    fleet = Interval(CheckpointConfig(every="auto", mtbf_hours_per_device=100.0), num_devices=1)
    big, big_tau = fleet.interval_s(30.0)
    assert big == pytest.approx(3000) and big_tau > 4000
    # Young-Daly already under the cap (system MTBF 1 h, 0.5 s saves: 60 s): kept.
    short = Interval(CheckpointConfig(every="auto", mtbf_hours_per_device=8.0), num_devices=8)
    assert short.interval_s(0.5)[0] == short.interval_s(0.5)[1] == daly_interval_s(0.5, 3600)
    # Through choose: its log names the interval kept, Young-Daly's and the cap.
    small.observe(9, blocked_s=0.2, step_time_s=0.05)
    logged = small.observe(20, blocked_s=0.2, step_time_s=0.05)
    assert logged["interval_s"] == 600 and logged["interval_steps"] == 12_000
    assert logged["young_daly_s"] == tau and logged["expected_overhead"] < 0.001


@pytest.mark.slow
def test_auto_interval_is_logged_with_its_inputs(tmp_path):
    # Six steps (the NaN of step 6 is not reached) of a 22.5 s system MTBF: the first save
    # waits 22.5 s of steps, so the only save is the final one, which sets the interval.
    _fit(tmp_path, 6, CheckpointConfig(every="auto", mtbf_hours_per_device=0.05), log_every=4)
    records = read_metrics(tmp_path / "metrics.jsonl")
    events = [r for r in records if r.get("event") == "checkpoint_interval"]
    want = {"interval_steps", "interval_s", "young_daly_s", "cap_s", "save_blocked_s"}
    assert events and want | {"mtbf_system_s", "step_time_s"} <= set(events[0])
    saves = [r for r in records if r.get("event") == "save"]
    assert [r["step"] for r in saves] == [5] and saves[0]["blocked_s"] > 0  # none at step 0
    assert pathlib.Path(tmp_path / "checkpoints" / "5").is_dir()  # the final step is saved


def test_auto_interval_is_chosen_once_the_step_time_is_known_and_saves_on_it(tmp_path):
    """No save comes at step 0, before any step time: the first waits for one (as soon as a
    steady step is timed) and then the MTBF's worth of steps, the interval is chosen from its
    cost, and saves then follow it, not only the final step. A 0.00005 h device MTBF on 8
    devices is a 0.0225 s system MTBF: the interval is a few steps however fast they run (at
    0.0005 h, CI's 10 ms steps made it 22 of 20)."""
    steps = 20
    auto = CheckpointConfig(every="auto", mtbf_hours_per_device=0.00005)
    _fit(tmp_path, steps, auto, log_every=8)
    records = read_metrics(tmp_path / "metrics.jsonl")
    chosen = [r for r in records if r.get("event") == "checkpoint_interval"]
    assert chosen and chosen[0]["step"] < steps - 1, chosen
    saved = [r["step"] for r in records if r.get("event") == "save"]
    assert saved[0] >= 2, saved  # not before a steady step (step 2) is timed
    between = [s for s in saved if 0 < s < steps - 1]
    assert len(between) >= 2, (saved, chosen)  # before the fix: [0, 15]
    every = max(c["interval_steps"] for c in chosen)  # it adapts, save by save
    assert all(b - a <= every for a, b in zip(between, between[1:], strict=False)), (saved, every)


def test_a_resumed_auto_interval_uses_the_earlier_save_costs_and_keeps_saving(tmp_path):
    """A resumed attempt has no save of its own to learn the cost from (its last save is the
    restored step): it takes the costs the run logged, and saves on the interval they give."""
    auto = CheckpointConfig(every="auto", mtbf_hours_per_device=0.00005)
    _fit(tmp_path, 8, auto, log_every=8)
    _fit(tmp_path, 24, auto, log_every=8)  # resumes after step 7
    records = read_metrics(tmp_path / "metrics.jsonl")
    second = records[max(i for i, r in enumerate(records) if "attempt" in r) :]
    saved = [r["step"] for r in second if r.get("event") == "save"]
    assert len([s for s in saved if 8 <= s < 23]) >= 2, saved  # before the fix: [23]
    assert 8 not in saved  # no save at once only to measure its cost
