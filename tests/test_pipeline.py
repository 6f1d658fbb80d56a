"""Pipeline parallelism: every schedule gives the non-pipelined losses and parameters, alone
and combined with data, FSDP and tensor parallelism; schedules keep their promises."""

import jax
import numpy as np
import pytest

from jaxdist.checkpoint import Checkpointer, param_shapes
from jaxdist.data import DataConfig, TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.optim import OptimConfig, make_optimizer
from jaxdist.pipeline import make_schedule
from jaxdist.step import StepConfig, build
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from models.transformer import Transformer
from tests.helpers import mesh_for

STEPS, LAYERS = 3, 8


def _compiled(layout, schedule="1f1b", microbatches=4, layers=LAYERS, batch=16):
    mc = get_model_config("tiny", num_layers=layers)
    tx, lr = make_optimizer(OptimConfig(warmup_steps=2), STEPS)
    return mc, build(
        lambda r: Transformer(mc, r),
        tx,
        lr,
        STANDARD_RULES,
        mesh_for(layout),
        StepConfig(microbatches, pipeline_schedule=schedule),
        0,
        batch,
    )


def _run(layout, schedule="1f1b", microbatches=4):
    mc, c = _compiled(layout, schedule, microbatches)
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    state, losses = c.init_fn(), []
    for s in range(STEPS):
        state, m = c.step_fn(state, jax.device_put(data.batch(s), c.batch_sharding))
        losses.append(float(m["loss"]))
    return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference():
    return _run("single")


@pytest.mark.parametrize(
    "layout, schedule",
    [
        ("pipeline=8", "gpipe"),
        ("pipeline=4,data=2", "1f1b"),
        ("pipeline=4,data=2", "gpipe"),
        ("pipeline=2,data=2,tensor=2", "1f1b"),
        ("pipeline=2,fsdp=4", "1f1b"),
    ],
)
def test_pipelined_equals_unpipelined(reference, layout, schedule):
    ref_losses, ref_params = reference
    microbatches = 8 if layout == "pipeline=8" else 4
    losses, params = _run(layout, schedule, microbatches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 4), (4, 8), (4, 16), (8, 32)])
def test_schedules_keep_their_promises(p, m):
    g, f = make_schedule("gpipe", p, m), make_schedule("1f1b", p, m)
    for sched in (g, f):
        # every stage runs every microbatch forward once and backward once
        for s in range(p):
            assert sorted(sched.mbs[sched.ops[:, s] == 1, s]) == list(range(m))
            assert sorted(sched.mbs[sched.ops[:, s] == 2, s]) == list(range(m))
    # GPipe: 2(m + p - 1) ticks; idle share (p-1)/(m+p-1), the textbook bubble
    assert g.ticks == 2 * (m + p - 1)
    assert g.bubble() == pytest.approx((p - 1) / (m + p - 1))
    assert f.bubble() == pytest.approx((p - 1) / (m + p - 1))
    # 1F1B: at most p - s microbatches in flight on stage s; GPipe holds all m
    for s in range(p):
        in_flight = np.cumsum((f.ops[:, s] == 1).astype(int) - (f.ops[:, s] == 2))
        assert in_flight.max() <= p - s
    assert f.capacity == p and g.capacity == m


def test_pipelined_checkpoint_restores_unpipelined(tmp_path):
    _, a = _compiled("pipeline=4,data=2")
    state = a.init_fn()
    saved = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
    ck = Checkpointer(tmp_path)
    ck.save(0, state, {"param_shapes": param_shapes(a.abstract_state.params), "mesh": {}})
    ck.close()
    _, b = _compiled("data=8", microbatches=1)
    r = Checkpointer(tmp_path).restore_latest(
        b.abstract_state, param_shapes(b.abstract_state.params)
    )
    for x, y in zip(jax.tree.leaves(jax.device_get(r.state)), saved, strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)


def test_bad_pipeline_input():
    with pytest.raises(
        ConfigError,
        match=r"'layers' of size 2 is not divisible by mesh axes "
        r"pipeline \(size 4\)",
    ):
        _compiled("pipeline=4,data=2", layers=2)
    with pytest.raises(ConfigError, match="1f1b needs at least as many microbatches as stages"):
        _compiled("pipeline=4,data=2", microbatches=2)
    with pytest.raises(ConfigError, match="not divisible by 3 microbatches"):
        _compiled("pipeline=2,data=4", microbatches=3)
    with pytest.raises(ConfigError, match="does not split over"):
        _compiled("pipeline=2,data=4", microbatches=4, batch=8)
    assert build_mesh(parse_mesh("pipeline=2,data=4")).shape["pipeline"] == 2


@pytest.mark.parametrize(
    "layout, schedule", [("pipeline=2,data=4", "gpipe"), ("pipeline=2,data=2,tensor=2", "1f1b")]
)
def test_comm_reports_the_permute_bytes_the_schedule_implies(layout, schedule):
    import json

    from tests.helpers import cli

    r = cli(
        "comm",
        "--model",
        "tiny",
        "--mesh",
        layout,
        "--devices",
        "cpu:8",
        "--microbatches",
        "4",
        "--pipeline-schedule",
        schedule,
        "--json",
    )
    assert r.returncode == 0, r.stderr
    (row,) = [x for x in json.loads(r.stdout)["rows"] if x["kind"] == "collective-permute"]
    assert row["axis"] == "pipeline" and row["ratio"] == pytest.approx(1.0, abs=0.05)
    p = int(layout.split(",")[0].split("=")[1])
    assert row["count"] == 2 * make_schedule(schedule, p, 4).ticks  # both ways, every tick
