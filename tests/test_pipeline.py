"""Pipeline parallelism: every schedule gives the non-pipelined losses and parameters, alone
and combined with data, FSDP and tensor parallelism; schedules keep their promises."""

import json

import jax
import numpy as np
import pytest

from jaxdist.checkpoint.store import Checkpointer, param_shapes
from jaxdist.compiled import comm_report
from jaxdist.config import DataConfig, OptimConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.layout import Layout, StepConfig
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.optim import make_optimizer
from jaxdist.parallel import pipeline
from jaxdist.parallel.pipeline import make_schedule, recv_table
from jaxdist.rules import batch_ways
from jaxdist.step import build
from meshes.presets import STANDARD_RULES
from models.inventory import plan_model
from models.presets import get_model_config
from models.transformer import Transformer
from tests.helpers import mesh_for

STEPS, LAYERS = 3, 8
# The quick loop (-m "not slow") keeps one pipelined case, pipeline=4,data=2 interleaved, and
# what shares its compiled programs (its init, its step in the comm report).
SLOW = pytest.mark.slow


def _compiled(
    layout, schedule="1f1b", microbatches=4, layers=LAYERS, batch=16, virtual=1, chunk=8192
):
    mc = get_model_config("tiny", num_layers=layers)
    tx, lr = make_optimizer(OptimConfig(warmup_steps=2), STEPS)
    mesh = mesh_for(layout)
    step = StepConfig(
        microbatches, pipeline_schedule=schedule, virtual_stages=virtual, loss_chunk_tokens=chunk
    )
    layout = Layout.on(mesh, STANDARD_RULES, step, batch_size=batch, seq_len=mc.seq_len)
    return mc, build(lambda r: Transformer(mc, r), tx, lr, layout, mesh)


def _run(layout, schedule="1f1b", microbatches=4, virtual=1, chunk=8192):
    mc, c = _compiled(layout, schedule, microbatches, virtual=virtual, chunk=chunk)
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    state, losses = c.init_fn(), []
    for s in range(STEPS):
        state, m = c.step_fn(state, jax.device_put(data.batch(s), c.batch_sharding))
        losses.append(float(m["loss"]))
    return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference():
    return _run("single")


# One case per mechanism (compiling a layout's step is most of this file's time). The stage
# code differs by: virtual stages (v > 1: layer chunks shuffled into place and back), the batch
# axes beside `pipeline` (manual inside the shard_map: data replicates the weights, fsdp shards
# them, gathered per stage), the axes left to the partitioner (tensor), and the last stage's
# loss: fused in one chunk (the default 8192 tokens: a device's 2 x 128 per microbatch fit),
# fused in several chunks (64 tokens, summed in a scan inside the shard_map) or unfused (0:
# whole logits). Schedules differ only by their tables (checked below without a compile; gpipe's
# step is compiled by test_comm_reports_the_permute_bytes_the_schedule_implies), so gpipe over
# eight stages with no batch axis beside them is a study (-m experiment).
@pytest.mark.parametrize(
    "layout, schedule, virtual, chunk",
    [
        pytest.param("pipeline=8", "gpipe", 1, 8192, marks=pytest.mark.experiment),
        ("pipeline=4,data=2", "interleaved", 2, 8192),
        pytest.param("pipeline=2,data=2,tensor=2", "1f1b", 1, 64, marks=SLOW),
        pytest.param("pipeline=2,data=2,tensor=2", "interleaved", 2, 0, marks=SLOW),
        pytest.param("pipeline=2,fsdp=4", "interleaved", 4, 8192, marks=SLOW),
    ],
)
def test_pipelined_equals_unpipelined(reference, layout, schedule, virtual, chunk):
    ref_losses, ref_params = reference
    microbatches = 8 if layout == "pipeline=8" else 4
    losses, params = _run(layout, schedule, microbatches, virtual, chunk)
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


@pytest.mark.parametrize(
    "p, v, m", [(2, 2, 2), (2, 4, 6), (4, 2, 4), (4, 2, 8), (4, 3, 16), (8, 2, 16)]
)
def test_interleaved_schedule_keeps_its_promises(p, v, m):
    sched = make_schedule("interleaved", p, m, v)
    for s in range(p):
        for k in range(v):
            for op in (1, 2):
                mine = (sched.ops[:, s] == op) & (sched.chunks[:, s] == k)
                assert sorted(sched.mbs[mine, s]) == list(range(m))
    # v chunks per stage shrink the bubble v-fold: (p-1)/(vm) of the busy time
    assert sched.ticks == 2 * (v * m + p - 1)
    assert sched.bubble() == pytest.approx((p - 1) / (v * m + p - 1))
    idle = np.sum(sched.ops == 0) / p
    assert idle / (2 * v * m) == pytest.approx((p - 1) / (v * m))
    # in flight on stage s: at most its warm-up forwards plus one
    for s in range(p):
        in_flight = np.cumsum((sched.ops[:, s] == 1).astype(int) - (sched.ops[:, s] == 2))
        assert in_flight.max() <= (v - 1) * p + p - s
    # Replays the buffers: every read finds the microbatch and chunk it expects, so the
    # slots (chunk * capacity + mb % capacity) never overwrite a live entry.
    C = p * v
    at = {}  # (buffer, stage, slot) -> (chunk, mb)
    recv = {1: recv_table(sched, 1), 2: recv_table(sched, 2)}
    for t in range(sched.ticks):
        for s in range(p):
            for op, buf in ((1, "f"), (2, "b")):
                if t and recv[op][t, s] >= 0:
                    src = (s - 1) % p if op == 1 else (s + 1) % p
                    c = sched.chunks[t - 1, src] * p + src + (1 if op == 1 else -1)
                    at[(buf, s, recv[op][t, s])] = (c, sched.mbs[t - 1, src])
        for s in range(p):
            op, i, k = sched.ops[t, s], sched.mbs[t, s], sched.chunks[t, s]
            c, slot = k * p + s, sched.slots()[t, s]
            if op == 1:
                if c:
                    assert at[("f", s, slot)] == (c, i)
                at[("x", s, slot)] = (c, i)
                if c == C - 1:
                    at[("b", s, slot)] = (c, i)
            elif op == 2:
                assert at[("x", s, slot)] == (c, i)
                assert at[("b", s, slot)] == (c, i)


def test_interleaved_shuffle_places_chunks_and_returns_them():
    for p, v in [(2, 2), (2, 4), (4, 2), (4, 3), (8, 2)]:
        stored = np.arange(p * v).reshape(p, v)  # stage d holds chunks dv .. dv+v-1
        placed = np.full((p, v + 1), -1)
        for shift, send_j, recv_k in pipeline.shuffle_plan(p, v):
            for d in range(p):
                placed[(d + shift) % p, recv_k[(d + shift) % p]] = stored[d, send_j[d]]
        # stage d runs chunks d, d+p, ...
        np.testing.assert_array_equal(placed[:, :v], np.arange(p * v).reshape(v, p).T)
        back = np.full((p, v + 1), -1)
        for shift, send_j, recv_k in pipeline.shuffle_plan(p, v, back=True):
            for d in range(p):
                back[(d + shift) % p, recv_k[(d + shift) % p]] = placed[d, send_j[d]]
        np.testing.assert_array_equal(back[:, :v], stored)


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved", 2)])
def test_pipelined_checkpoint_restores_unpipelined(tmp_path, schedule, virtual):
    _, a = _compiled("pipeline=4,data=2", schedule, virtual=virtual)
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
    with pytest.raises(
        ConfigError, match=r"8 layers are not divisible by 12; use --virtual-stages 2"
    ):
        _compiled("pipeline=4,data=2", "interleaved", virtual=3)
    with pytest.raises(
        ConfigError, match=r"multiple of the 4 pipeline stages \(got 2\); use --microbatches 4"
    ):
        _compiled("pipeline=4,data=2", "interleaved", microbatches=2, virtual=2)
    with pytest.raises(ConfigError, match="interleaved needs --virtual-stages 2 or more"):
        _compiled("pipeline=4,data=2", "interleaved", virtual=1)
    with pytest.raises(
        ConfigError, match="--virtual-stages 2 applies to the interleaved schedule; add --pipel"
    ):
        _compiled("pipeline=4,data=2", "1f1b", virtual=2)
    with pytest.raises(ConfigError, match="not divisible by 3 microbatches"):
        _compiled("pipeline=2,data=4", microbatches=3)
    with pytest.raises(ConfigError, match="does not split over"):
        _compiled("pipeline=2,data=4", microbatches=4, batch=8)
    assert build_mesh(parse_mesh("pipeline=2,data=4")).shape["pipeline"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, schedule", [("pipeline=2,data=4", "gpipe"), ("pipeline=2,data=2,tensor=2", "1f1b")]
)
def test_comm_reports_the_permute_bytes_the_schedule_implies(capsys, layout, schedule):
    # In this process (its devices are the 8 fake CPUs --devices asks for; the session's
    # compile cache stays as it is).
    from jaxdist.cli.main import main

    args = ["--mesh", layout, "--devices", "cpu:8", "--compile-cache", "off", "--json"]
    rc = main(
        ["comm", "--model", "tiny", *args, "--microbatches", "4", "--pipeline-schedule", schedule]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    (row,) = [x for x in json.loads(out.out)["rows"] if x["kind"] == "collective-permute"]
    assert row["axis"] == "pipeline" and row["ratio"] == pytest.approx(1.0, abs=0.05)
    p = int(layout.split(",")[0].split("=")[1])
    assert row["count"] == 2 * make_schedule(schedule, p, 4).ticks  # both ways, every tick


@pytest.mark.parametrize(
    "layout, virtual", [("pipeline=4,data=2", 2), pytest.param("pipeline=2,fsdp=4", 4, marks=SLOW)]
)
def test_comm_reports_the_interleaved_permute_bytes(layout, virtual):
    # Through the Python API, as `jaxdist comm` computes it: activations both ways every tick,
    # plus the layer chunks moved into interleaved placement and their gradients back. The
    # layouts' steps are test_pipelined_equals_unpipelined's: the session's compile cache has
    # them.
    mc, c = _compiled(layout, "interleaved", virtual=virtual)
    mesh, p = mesh_for(layout), int(layout.split(",")[0].split("=")[1])
    sched = make_schedule("interleaved", p, 4, virtual)
    ways = batch_ways(c.batch_sharding)
    act = pipeline.microbatch_bytes(16, 4, ways, mc.seq_len, mc.d_model, 4)
    expected = pipeline.send_bytes(sched, c.abstract_state.params, STANDARD_RULES, mesh.shape, act)
    report = comm_report.report(c, plan_model(mc), c.layout)
    (row,) = [x for x in report["rows"] if x["kind"] == "collective-permute"]
    assert row["expected_bytes"] == pytest.approx(expected)
    assert row["axis"] == "pipeline" and row["ratio"] == pytest.approx(1.0, abs=0.05)
    shifts = sum(1 for shift, _, _ in pipeline.shuffle_plan(p, virtual) if shift)
    layer_arrays = sum(1 for k in c.abstract_state.params.keys() if "_L" in k)
    assert row["count"] == 2 * sched.ticks + 2 * shifts * layer_arrays
