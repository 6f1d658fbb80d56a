"""Replica groups (DiLoCo, jaxdist.parallel.replica): one group syncing every step is plain
training; groups move nothing between syncs and each weight's shard once each way at one, in
the sync type; a run killed mid-round resumes bitwise; bad settings end in one line.

PyTorch's DiLoCo loop is the reference for M = 2 (tests/test_torch_diloco.py)."""

import collections
import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.cli.main import main
from jaxdist.cluster.join import metric_value
from jaxdist.compiled import hlo
from jaxdist.config import OptimConfig
from jaxdist.errors import ConfigError
from jaxdist.layout import Layout, StepConfig, SyncConfig
from jaxdist.optim import make_optimizer
from jaxdist.parallel import exchange, replica, rounds
from jaxdist.step import build
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from models.transformer import Transformer
from tests.extras import needs_tpu
from tests.helpers import cli, losses, mesh_for

B = 16
PLAIN = StepConfig()


def _built(
    mesh_text: str,
    sync: SyncConfig | None,
    model: str = "tiny",
    steps: int = 10,
    step: StepConfig = PLAIN,
):
    mc = get_model_config(model)
    mesh = mesh_for(mesh_text)
    tx, lr = make_optimizer(OptimConfig(warmup_steps=2), steps)
    layout = Layout.on(mesh, STANDARD_RULES, step, batch_size=B, seq_len=mc.seq_len, sync=sync)
    return mc, mesh, build(lambda r: Transformer(mc, r), tx, lr, layout, mesh)


def _train(
    mesh_text: str,
    sync: SyncConfig | None,
    model: str,
    steps: int,
    step: StepConfig = PLAIN,
):
    """Losses, weights and the step that trained them (its compiled programs in jit's cache)."""
    mc, _, jitted = _built(mesh_text, sync, model, steps, step)
    state, out = jitted.init_fn(), []
    for s in range(steps):
        tokens = jax.random.randint(jax.random.key(s), (B, mc.seq_len + 1), 0, mc.vocab_size)
        extra = (rounds.action(sync, s),) if sync else ()
        state, metrics = jitted.step_fn(
            state, jax.device_put(tokens, jitted.batch_sharding), *extra
        )
        out.append(metric_value("loss", metrics["loss"]))  # groups' own, averaged on the host
    return np.array(out), jax.device_get(jitted.weights(state)), jitted


@pytest.mark.parametrize(
    "mesh_text, model",
    [
        ("data=2,fsdp=2,tensor=2", "tiny"),
        # -m experiment (the suite's time): experts and context inside the groups
        pytest.param("expert=2,context=2,fsdp=2", "tiny-moe", marks=pytest.mark.experiment),
    ],
)
def test_one_group_syncing_every_step_with_a_plain_outer_step_is_plain_training(mesh_text, model):
    # M = 1, H = 1, outer lr 1, no momentum: the outer weights become the group's own each step.
    plain, w_plain, _ = _train(mesh_text, None, model, 4)
    sync = SyncConfig(sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    grouped, w_grouped, _ = _train(f"replica=1,{mesh_text}", sync, model, 4)
    np.testing.assert_allclose(grouped, plain, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(w_grouped), jax.tree.leaves(w_plain), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_groups_run_a_pipeline_inside_as_they_run_the_plain_step():
    # The pipeline's shard_map, mapped over the groups (jaxdist.parallel.pipeline
    # _mapped_over_groups): the same losses and weights as the groups without a pipeline, over
    # three syncs, and still nothing over `replica` between syncs.
    sync, micro = SyncConfig(sync_every=2), StepConfig(microbatches=2)
    flat, w_flat, _ = _train("replica=2,fsdp=4", sync, "tiny", 6, micro)
    piped, w_piped, jitted = _train("replica=2,pipeline=2,fsdp=2", sync, "tiny", 6, micro)
    np.testing.assert_allclose(piped, flat, rtol=1e-5)
    assert len(set(np.round(piped, 4))) == 6, piped  # the groups trained: every loss differs
    for a, b in zip(jax.tree.leaves(w_piped), jax.tree.leaves(w_flat), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    # The step that trained (the inner program, act None, in jit's cache): a step built anew
    # traced and compiled it again, 15 of the test's 60 s.
    assert sum(_replica_traffic(jitted, jitted.batch_sharding.mesh, None).values()) == 0


def _replica_collectives(jitted, mesh, act) -> list[tuple[str, str, int]]:
    """(kind, element type, bytes per device) of each collective over `replica`."""
    mc_batch = (B, jitted.layout.seq_len + 1)
    batch = jax.ShapeDtypeStruct(mc_batch, jnp.int32, sharding=jitted.batch_sharding)
    text = jitted.step_fn.lower(jitted.abstract_state, batch, act).compile().as_text()
    lines = {m.group(1): m.group(2) for m in re.finditer(r"%([\w.\-]+) = \(?(\w+)\[", text)}
    return [
        (c.kind, lines.get(c.name, "?"), c.bytes)
        for c in hlo.collectives(text, dict(mesh.shape))
        if "replica" in c.axes
    ]


def _replica_traffic(jitted, mesh, act) -> dict[tuple[str, str], int]:
    """(kind, element type) -> bytes per device of the collectives over `replica`."""
    moved: dict[tuple[str, str], int] = {}
    for kind, dtype, size in _replica_collectives(jitted, mesh, act):
        moved[kind, dtype] = moved.get((kind, dtype), 0) + size
    return moved


def _share_bytes(jitted) -> int:
    """Bytes of one group's float32 weights one device holds."""
    total = 0
    for x in jax.tree.leaves(jitted.abstract_state.params):
        total += 4 * np.prod(x.sharding.shard_shape(x.shape))
    return int(total)


def test_groups_move_no_tensor_between_syncs_and_each_shard_once_each_way_at_one():
    mesh_text = "replica=2,fsdp=2,tensor=2"
    _, mesh, f32 = _built(mesh_text, SyncConfig(sync_every=4))
    share = _share_bytes(f32)  # the group's weights on one device ([1, ...] of [M, ...])
    inner = _replica_traffic(f32, mesh, None)
    # Nothing crosses, not even the logged metrics: each group's own, averaged on the host.
    assert sum(inner.values()) == 0, inner
    outer = _replica_traffic(f32, mesh, rounds.action(SyncConfig(sync_every=4), 3))
    assert outer[("all-to-all", "f32")] == share, outer  # up: each shard once
    assert outer[("all-gather", "f32")] == share, outer  # down: each shard once
    assert sum(v for (_, t), v in outer.items() if t == "f32") == 2 * share, outer

    _, _, q8 = _built(mesh_text, SyncConfig(sync_every=4, sync_dtype="int8"))
    outer8 = _replica_traffic(q8, mesh, rounds.action(SyncConfig(sync_every=4), 3))
    # The 8-bit payload is a quarter of float32's, each way; the float32 scales (one per row
    # of 64 to 512 elements in this tiny model) and their row maxima add the rest.
    assert outer8[("all-to-all", "u8")] == share // 4, outer8
    assert outer8[("all-gather", "u8")] == share // 4, outer8
    assert sum(outer8.values()) <= 0.25 * sum(outer.values()) * (1 + 4 * 4 / 64), outer8


@pytest.mark.parametrize(
    "dtype, payload, parts",
    [("float32", "f32", 4), ("bfloat16", "u16", 2), ("int8", "u8", 1)],
)
def test_the_outer_exchange_is_one_collective_per_type_and_way(dtype, payload, parts):
    # The slow link's latency is paid per message: the 13 leaves of the tiny model travel in
    # one all-to-all up and one all-gather down (the 8-bit types: one more each way for their
    # scales, nothing else), with the bytes each leaf alone would take.
    _, mesh, jitted = _built(
        "replica=2,fsdp=2,tensor=2", SyncConfig(sync_every=4, sync_dtype=dtype)
    )
    ops = _replica_collectives(jitted, mesh, rounds.action(SyncConfig(sync_every=4), 3))
    kinds = collections.Counter((kind, t) for kind, t, _ in ops)
    expected = {("all-to-all", payload): 1, ("all-gather", payload): 1}
    if dtype == "int8":
        expected |= {("all-to-all", "f32"): 1, ("all-gather", "f32"): 1}
    assert kinds == expected, ops
    share = _share_bytes(jitted)
    assert [b for k, t, b in ops if t == payload] == [share * parts // 4] * 2, ops


@pytest.mark.slow
@pytest.mark.parametrize(
    "sync",
    [
        # -m experiment (37 s; the suite's time): the suite holds float32's bucketed exchange
        # to plain training (M = 1) and to PyTorch's DiLoCo (test_torch_diloco)
        pytest.param(
            SyncConfig(sync_every=4, sync_fragments=2, sync_delay=1), marks=pytest.mark.experiment
        ),
        # int8's too (23 s): the suite holds its collectives and bytes (test_the_outer_exchange_...)
        pytest.param(SyncConfig(sync_every=2, sync_dtype="int8"), marks=pytest.mark.experiment),
    ],
    ids=["float32-streamed", "int8"],
)
def test_the_bucketed_exchange_gives_the_per_leaf_exchanges_weights(sync, monkeypatch):
    steps = 6 if sync.sync_dtype == "float32" else 2  # 8 bits: one sync, before training on
    losses_, weights, _ = _train("replica=2,fsdp=2,tensor=2", sync, "tiny", steps)
    # Every leaf on the per-leaf path (exchange.up, down): one collective a leaf, as before.
    monkeypatch.setattr(exchange, "bucket_dim", lambda *_: (None, True))
    alone, alone_weights, _ = _train("replica=2,fsdp=2,tensor=2", sync, "tiny", steps)
    pairs = list(zip(jax.tree.leaves(weights), jax.tree.leaves(alone_weights), strict=True))
    if sync.sync_dtype == "float32":  # the same values, moved in fewer messages: bitwise
        np.testing.assert_array_equal(losses_, alone)
        for a, b in pairs:
            np.testing.assert_array_equal(a, b)
        return
    # In 8 bits XLA fuses the outer update's float32 arithmetic around the exchange another way
    # (the exchanges alone agree bitwise, on ties too): a value 1 ulp off an 8-bit level's edge
    # rounds to the next level. Measured: 20 of 476,416 weights one level (<= 1.6e-5) apart.
    for a, b in pairs:
        np.testing.assert_allclose(a, b, atol=1e-4)
    assert sum(int(np.sum(a != b)) for a, b in pairs) < 1e-3 * _size(weights)


def _size(tree) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(tree))


def test_streamed_fragments_take_turns_and_delay_applies_later():
    sync = SyncConfig(sync_every=8, sync_fragments=2, sync_delay=2)
    acts = {s: rounds.action(sync, s) for s in range(20)}
    # Fragment 1's round ends after steps 3, 11, 19; fragment 0's after 7, 15. The exchange
    # runs on the next step's input, the groups take the result 2 steps after the round.
    sends = {s: a.send for s, a in acts.items() if a and a.send}
    applies = {s: a.apply for s, a in acts.items() if a and a.apply}
    assert sends == {4: (1,), 8: (0,), 12: (1,), 16: (0,)}
    assert applies == {5: (1,), 9: (0,), 13: (1,), 17: (0,)}


# 36 s (three processes and their compiles): -m experiment, to keep the suite under 15 minutes;
# tests/test_recovery.py's kill -9 test holds a bitwise resume of a plain run.
@pytest.mark.experiment
def test_a_run_killed_mid_round_resumes_bitwise_and_onto_another_group_layout(tmp_path, capsys):
    # Steps of 8 rows of 32 tokens: what is checked (a resume inside a round, bitwise; the
    # refusals; the new layout) does not depend on their size.
    mesh = ["--mesh", "replica=2,fsdp=2,tensor=2"]
    args = ["train", "--sync-every", "4", "--sync-dtype", "int8", "--log-every", "1"]
    args += ["--batch-size", "8", "--seq-len", "32", "--checkpoint-every", "3"]

    def here(*argv: str) -> tuple[int, str]:
        """`jaxdist *argv` in this process (no interpreter to start: the runs nothing kills,
        and those refused before training); its exit code and stderr."""
        capsys.readouterr()
        rc = main(list(argv))
        return rc, capsys.readouterr().err

    rc, err = here(*args, *mesh, "--steps", "10", "--run-dir", str(tmp_path / "whole"))
    assert rc == 0, err
    assert "outer step: lr 1, momentum 0 (auto: plain averaging, H = 4 is below 30)" in err
    # Killed (SIGKILL) before step 7: the newest checkpoint committed (step 5, or 2 if 5's
    # async save was still writing) lies inside a round.
    run = ["--run-dir", str(tmp_path / "killed")]
    first = cli(*args, *mesh, "--steps", "10", *run, "--fault", "kill:7:0")
    assert first.returncode == -9, first.stderr
    again = cli(*args, *mesh, "--steps", "10", *run)
    assert again.returncode == 0, again.stderr
    assert re.search("resuming from checkpoint step [25] ", again.stderr), again.stderr
    assert "(auto: as the run chose at its start, recorded in its checkpoint)" in again.stderr
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole")
    # Another number of groups, or of steps between syncs, is refused, naming the field ...
    for flags, field in (
        (["--mesh", "replica=4,fsdp=2", "--sync-every", "4"], "--mesh (its replica axis) 2 -> 4"),
        (mesh + ["--sync-every", "2"], "--sync-every 4 -> 2"),
    ):
        changed = [a for a in args if a not in ("--sync-every", "4")]
        rc, err = here(*changed, *flags, "--steps", "12", *run)
        assert rc == 2 and field in err, err
    # ... while each group laid out anew (tensor=2 -> data=2) goes on from step 10.
    rc, err = here(*args, "--mesh", "replica=2,data=2,fsdp=2", "--steps", "12", *run)
    assert rc == 0, err
    assert set(losses(tmp_path / "killed")) == set(range(12))
    # The model the run made is the outer weights, read alone on any mesh (no groups).
    export = ["export-hf", str(tmp_path / "killed"), str(tmp_path / "hf")]
    assert here(*export, "--mesh", "fsdp=8")[0] == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "replica=2,fsdp=4", "--sync-every", "0"], "--sync-every 0 must be at least"),
        (
            ["--mesh", "replica=2,fsdp=4", "--sync-every", "6", "--sync-fragments", "3"],
            "does not divide the model's 2 layers",
        ),
        (
            ["--mesh", "replica=2,fsdp=4", "--sync-every", "8", "--sync-fragments", "2"]
            + ["--sync-delay", "4"],
            "must be shorter than a fragment's turn",
        ),
        (["--mesh", "fsdp=8", "--sync-every", "4"], "add replica=M to --mesh"),
        (["--mesh", "replica=2,fsdp=4", "--batch-size", "12"], "does not split"),
    ],
)
def test_bad_sync_settings_are_one_line(args, message, tmp_path):
    result = cli("train", "--steps", "2", "--run-dir", str(tmp_path / "run"), *args)
    assert result.returncode == 2, result.stderr
    errors = [x for x in result.stderr.splitlines() if x.startswith("jaxdist: error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), result.stderr
    assert not (tmp_path / "run").exists()


def test_a_replica_axis_without_sync_settings_is_refused_in_python():
    mesh = mesh_for("replica=2,fsdp=2,tensor=2")
    layout = Layout.on(mesh, STANDARD_RULES, StepConfig(), batch_size=B, seq_len=128)
    tx, lr = make_optimizer(OptimConfig(), 10)
    mc = get_model_config("tiny")
    with pytest.raises(ConfigError, match="SyncConfig"):
        build(lambda r: Transformer(mc, r), tx, lr, layout, mesh)


def test_rollback_is_refused_where_a_process_cannot_see_every_groups_flags():
    # Two processes of four devices each, one group each (replica outermost): between syncs
    # nothing tells process 0 that group 1's step was not finite.
    mesh = mesh_for("replica=2,fsdp=4")
    fake = [types.SimpleNamespace(process_index=i // 4) for i in range(8)]
    two_processes = types.SimpleNamespace(devices=np.array(fake).reshape(mesh.devices.shape))
    layout = Layout.on(
        mesh, STANDARD_RULES, StepConfig(), batch_size=B, seq_len=128, sync=SyncConfig()
    )
    replica.check_nonfinite(layout, two_processes, "skip")  # each group skips its own
    replica.check_nonfinite(layout, mesh, "rollback")  # one process sees every group
    with pytest.raises(ConfigError, match="process 0 holds groups \\[0\\] of 2.*--nonfinite skip"):
        replica.check_nonfinite(layout, two_processes, "rollback")


def test_the_logged_metrics_are_the_groups_own_averaged_on_the_host():
    mesh = mesh_for("replica=2,fsdp=2,tensor=2")
    per_group = NamedSharding(mesh, PartitionSpec("replica"))
    loss_M = jax.device_put(np.array([2.0, 3.0], np.float32), per_group)
    finite_M = jax.device_put(np.array([True, False]), per_group)
    assert metric_value("loss", loss_M) == 2.5
    assert metric_value("finite", finite_M) is False
    assert metric_value("loss", jax.device_put(np.float32(1.5))) == 1.5  # one scalar


@pytest.mark.slow
@needs_tpu
def test_the_tpu_compiler_holds_the_outer_state_as_priced_and_off_the_device_on_request():
    def argument_bytes(*mesh: str) -> int:
        args = ["train", "--model", "tiny", "--batch-size", "16", "--compile-only"]
        result = cli(*args, "--target", "v5p-16", "--json", "-", "--mesh", *mesh)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["per_device_bytes"]["argument"]

    data = argument_bytes("data=2,fsdp=4")
    groups = argument_bytes("replica=2,fsdp=4", "--sync-every", "4")
    on_host = argument_bytes("replica=2,fsdp=4", "--sync-every", "4", "--outer-memory", "host")
    # Each device: its group's weights and Adam moments (12 bytes a parameter, as data
    # parallelism's) and 1/M of the outer weights and momentum: (12 + 8/M) / 12 with M = 2,
    # plus the few norm scales too small to split (0.6% of the state in this tiny model).
    assert 16 / 12 <= groups / data <= 16 / 12 * 1.01, (groups, data)
    assert on_host == data, (on_host, data)  # kept in host memory: the device holds none


@pytest.mark.slow
def test_the_profile_shows_the_outer_step_on_the_steps_that_ran_it(tmp_path):
    run = tmp_path / "run"
    args = ["train", "--mesh", "replica=2,data=2,fsdp=2", "--sync-every", "2", "--steps", "8"]
    result = cli(*args, "--profile", "4:8", "--run-dir", str(run))
    assert result.returncode == 0, result.stderr
    report = json.loads((run / "profile" / "breakdown.json").read_text())
    outer = {r["step"]: r["outer_s"] for r in report["steps"] if r["device"] == 0}
    # Steps 5 and 7 end a round (s + 1 a multiple of 2): only they exchange over `replica`.
    assert [s for s, t in sorted(outer.items()) if t > 0] == [5, 7], outer
    assert report["summary"]["mean_per_device"]["outer_s"] > 0
    assert "the outer step" in result.stdout + result.stderr
