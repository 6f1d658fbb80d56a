"""--optimizer muon: Muon on the weight matrices that the logical axes name, AdamW on the rest.

One device equals optax.contrib.muon (with AdamW on embeddings, head, norms and biases, labels
written out by hand here) over 10 steps; an update traced outside a step is refused; the
default layout equals one device; each Muon weight
moves twice its shard a step (jaxdist.parallel.muon), counted from the compiled HLO, and
`jaxdist comm` prices it so (the fallback's gather too); a resume with another optimizer is
refused in one line."""

import functools
import json
import math
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
import tyro
from flax import nnx
from optax.contrib import MuonDimensionNumbers as Dims
from optax.contrib import MuonState

from jaxdist.checkpoint.resume import compare_with_checkpoint
from jaxdist.cli.cmd_comm import Comm
from jaxdist.compiled import comm_report, hlo
from jaxdist.config import DataConfig, OptimConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.layout import Layout, StepConfig
from jaxdist.optim import make_optimizer, muon_dims, muon_labels, schedule
from jaxdist.rules import is_variable
from jaxdist.step import build
from meshes.presets import STANDARD_RULES, get_mesh_preset
from models.inventory import plan_model
from models.presets import get_model_config
from models.transformer import Transformer
from tests.helpers import mesh_for

# Past the 2 warm-up steps and down the schedule's decay; compiling is each run's cost, and 10
# steps check the same equalities as the 20 there were.
STEPS = 10
CONFIG = OptimConfig(optimizer="muon", warmup_steps=2)
# The tiny model's weights as Muon sees them (x @ W: reduction dims, output dims), written out
# by name: optim.py decides them from the logical axes alone.
MATRICES = {
    "wqkv_LDGQH": Dims((1,), (2, 3, 4)),
    "wo_LNHD": Dims((1, 2), (3,)),
    "w_up_LDF": Dims((1,), (2,)),
    "w_down_LFD": Dims((1,), (2,)),
}
# AdamW's weights that today's decay mask decays (two dims besides `layers`).
DECAYED = ("tok_embed_VD", "head_DV", "pos_embed_TD")


def _name(path) -> str:
    return path[-1].key


def _plain(tree) -> dict:
    """{name: array} of a model state of Variables (the reference optimizer's view)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]
    return {_name(path): var.get_value() for path, var in flat}


def _by_name(table: dict, default):
    """A tree of Variables holding table[name] (default where absent) for a model state."""

    def one(path, var):
        return var.replace(table.get(_name(path), default))

    return lambda params: jax.tree_util.tree_map_with_path(one, params, is_leaf=is_variable)


def _reference(config: OptimConfig, steps: int) -> optax.GradientTransformation:
    """Clipping, then optax.contrib.muon on MATRICES and optax.adamw on the rest, labelled
    by name."""
    muon = optax.contrib.muon(
        schedule(config, steps, config.muon_lr),
        ns_steps=config.muon_ns_steps,
        beta=config.muon_beta,
        eps=config.eps,
        weight_decay=config.weight_decay,
        muon_weight_dimension_numbers=_by_name(MATRICES, None),
    )
    adamw = optax.adamw(
        schedule(config, steps),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=_by_name(dict.fromkeys(DECAYED, True), False),
    )
    labels = _by_name(dict.fromkeys(MATRICES, "muon"), "adamw")
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.multi_transform({"muon": muon, "adamw": adamw}, labels),
    )


@functools.cache
def _run(layout: str, reference: bool = False, layers: int = 2):
    """STEPS steps of the tiny model on `layout`: (losses, final weights)."""
    mc = get_model_config("tiny", num_layers=layers)
    mesh = mesh_for(layout)
    tx, lr = make_optimizer(CONFIG, STEPS)
    if reference:
        tx = _reference(CONFIG, STEPS)
    step = Layout.on(mesh, STANDARD_RULES, StepConfig(), batch_size=16, seq_len=mc.seq_len)
    jitted = build(lambda r: Transformer(mc, r), tx, lr, step, mesh)
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    state, losses = jitted.init_fn(), []
    for s in range(STEPS):
        state, metrics = jitted.step_fn(state, jax.device_put(data.batch(s), jitted.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), _plain(jax.device_get(state.params))


def _assert_same_run(run, reference, tol: float):
    losses, weights = run
    ref_losses, ref_weights = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=tol)
    assert losses[-1] < losses[0]  # it learns
    for name, w in weights.items():
        np.testing.assert_allclose(w, ref_weights[name], atol=tol, err_msg=name)


def test_matrices_and_the_rest_are_decided_by_logical_axes():
    for name in ("tiny", "tiny-llama", "tiny-moe"):
        mc = get_model_config(name)
        params = nnx.split(nnx.eval_shape(lambda mc=mc: Transformer(mc, nnx.Rngs(0))))[1]
        labels = _plain(muon_labels(params))
        for key, label in labels.items():
            vector = key.startswith(("norm", "bias", "q_norm", "k_norm"))
            table = key in ("tok_embed_VD", "head_DV", "pos_embed_TD")
            assert label == ("adamw" if vector or table else "muon"), (name, key)
    assert muon_dims(("layers", "embed", "kv_heads", "qkv", "head_dim")) == MATRICES["wqkv_LDGQH"]
    assert muon_dims(("layers", "heads", "head_dim", "embed")) == MATRICES["wo_LNHD"]
    # The expert axis is a batch dim, like layers: one matrix per layer and expert.
    assert muon_dims(("layers", "expert", "mlp", "embed")) == Dims((2,), (3,))
    assert muon_dims(("layers", "expert", "embed", "mlp")) == Dims((2,), (3,))
    assert muon_dims(("layers", "embed")) is None


def test_one_device_equals_optax_contrib_muon_with_adamw_for_the_rest():
    _assert_same_run(_run("single"), _run("single", reference=True), 1e-5)


def test_an_update_traced_outside_a_step_is_refused_in_one_line():
    # Without activation_rules there is no mesh to move the momenta over: refused, not run
    # unsharded as the arrays lie (the slow path the module's docstring warns of).
    params = nnx.split(nnx.eval_shape(lambda: Transformer(get_model_config("tiny"), nnx.Rngs(0))))
    tx, _ = make_optimizer(CONFIG, STEPS)
    with pytest.raises(RuntimeError, match="outside activation_rules") as e:
        jax.eval_shape(lambda p: tx.update(p, tx.init(p), p), params[1])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layers", [2, 4])
def test_default_layout_equals_one_device(layers):
    # 4 layers: each fsdp x tensor group of 4 devices owns one layer's matrices for
    # Newton-Schulz (all-to-all); 2 layers: fewer than those devices, the matrices gathered.
    _assert_same_run(
        _run("data=2,fsdp=2,tensor=2", layers=layers), _run("single", layers=layers), 1e-5
    )


@functools.cache
def _compiled(optimizer: str, mesh_text: str, layers: int):
    """(model config, the built step) of the tiny model with `layers` layers."""
    mc = get_model_config("tiny", num_layers=layers)
    mesh = mesh_for(mesh_text)
    tx, lr = make_optimizer(OptimConfig(optimizer=optimizer, warmup_steps=2), STEPS)
    layout = Layout.on(mesh, STANDARD_RULES, StepConfig(), batch_size=16, seq_len=mc.seq_len)
    return mc, build(lambda r: Transformer(mc, r), tx, lr, layout, mesh)


# -m experiment (a minute each; the suite's time), with the larger presets below: the default
# layout above keeps Muon's all-to-alls (4 layers over 4 devices) and its gathered fallback.
@pytest.mark.experiment
@pytest.mark.parametrize("preset", ["gpu8", "gpu8-tp"])
def test_the_other_eight_device_presets_equal_one_device(preset):
    # cpu8 is the default layout above; gpu8 (fsdp=8, also v5p-16's) and gpu8-tp (fsdp=4 x
    # tensor=2) split the matrix dims over all 8 devices: with 8 layers each device owns one
    # layer's matrices. gpu2x8 and v5p-128 need 16 and 64 devices, more than the tests have.
    layout = ",".join(f"{a}={n}" for a, n in get_mesh_preset(preset).mesh.ici)
    _assert_same_run(_run(layout, layers=8), _single(8), 1e-5)


_LARGER = """
import jaxdist
jaxdist.setup_devices("cpu:{n}")
from tests import test_muon as t
t._assert_same_run(t._run("{layout}", layers=8), t._run("single", layers=8), 1e-5)
print("equal")
"""


@pytest.mark.experiment  # minutes on two cores: 16 and 64 fake devices in a process of their own
@pytest.mark.parametrize("preset", ["gpu2x8", "v5p-128"])
def test_the_larger_presets_equal_one_device(preset):
    # More devices than the suite's 8: a process of its own with as many fake CPU devices.
    mesh = get_mesh_preset(preset).mesh
    axes = (*mesh.dcn, *mesh.ici)
    layout = ",".join(f"{a}={n}" for a, n in axes)
    n = math.prod(size for _, size in axes)
    code = _LARGER.format(n=n, layout=layout)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "equal" in result.stdout, result.stderr[-3000:]


@functools.cache
def _single(layers: int):
    return _run("single", layers=layers)


def _step_traffic(optimizer: str, mesh_text: str, layers: int) -> dict[str, int]:
    """Collective kind -> bytes per device of one compiled step, and the muon weights' shard
    bytes on one device."""
    _, jitted = _compiled(optimizer, mesh_text, layers)
    mesh = jitted.batch_sharding.mesh
    moved: dict[str, int] = {}
    for c in hlo.collectives(jitted.compile_abstract().as_text(), dict(mesh.shape)):
        moved[c.kind] = moved.get(c.kind, 0) + c.bytes
    weights = [x for name, x in _plain(jitted.abstract_params).items() if name in MATRICES]
    moved["muon shard"] = sum(4 * math.prod(x.sharding.shard_shape(x.shape)) for x in weights)
    moved["muon whole"] = sum(4 * x.size for x in weights)
    # Muon's momentum is stored as its weight is (optax.partition's masks kept apart).
    params = _plain(jitted.abstract_params)
    states = jax.tree.leaves(jitted.abstract_state.opt_state, is_leaf=_is_muon)
    muon_states = [state for state in states if _is_muon(state)]
    assert len(muon_states) == (optimizer == "muon")
    for state in muon_states:
        for name in MATRICES:
            assert _plain(state.mu)[name].sharding == params[name].sharding, name
    return moved


def _is_muon(x) -> bool:
    return isinstance(x, MuonState)


def test_each_muon_weight_moves_twice_its_shard_in_all_to_alls():
    # 4 layers over fsdp x tensor = 4 devices: each owns one layer's matrices in turn.
    adamw = _step_traffic("adamw", "data=2,fsdp=2,tensor=2", 4)
    muon = _step_traffic("muon", "data=2,fsdp=2,tensor=2", 4)
    shard, whole = muon.pop("muon shard"), muon.pop("muon whole")
    # All of Muon's traffic is the all-to-all there and back: 2x each weight's shard, less than
    # gathering the whole weight on each device (XLA's own partitioning moved 17x that here).
    assert muon.pop("all-to-all") == 2 * shard < whole
    assert "all-to-all" not in adamw
    assert muon == {k: v for k, v in adamw.items() if not k.startswith("muon")}


@pytest.mark.parametrize("layers, kind", [(4, "all-to-all"), (2, "all-gather")])
def test_comm_prices_muons_moves_as_the_step_makes_them(layers, kind):
    # `jaxdist comm --optimizer muon` reads the optimizer as `train` does, and its report puts
    # the compiled step's collectives beside parallel.muon's own account of its moves: the
    # all-to-all there and back (4 layers: one per fsdp x tensor device), or the fallback's
    # one gather of the whole matrices (2 layers, fewer than those devices).
    assert tyro.cli(Comm, args=["--optimizer", "muon"]).optim.optimizer == "muon"
    mc, jitted = _compiled("muon", "data=2,fsdp=2,tensor=2", layers)
    rows = comm_report.report(jitted, plan_model(mc), jitted.layout, "muon")["rows"]
    muon = [r for r in rows if r["axis"] == "fsdp+tensor"]
    assert [r["kind"] for r in muon] == [kind]
    assert muon[0]["expected_bytes"] > 0
    assert muon[0]["bytes"] == pytest.approx(muon[0]["expected_bytes"], rel=1e-6)
    if kind == "all-to-all":
        assert muon[0]["bytes"] == _step_traffic("muon", "data=2,fsdp=2,tensor=2", 4)["all-to-all"]
    # Nothing else is left unpriced or mispriced by Muon (the gathers' 0.1% of scalars aside).
    for r in rows:
        assert r["ratio"] == pytest.approx(1.0, abs=0.005), r


def test_resuming_with_another_optimizer_is_refused_in_one_line(tmp_path):
    record = {"optim": {"optimizer": "adamw"}, "model": {"name": "tiny"}}
    meta = tmp_path / "checkpoints" / "7" / "meta"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text(json.dumps({"config": record}))
    with pytest.raises(ConfigError) as e:
        compare_with_checkpoint(tmp_path, {**record, "optim": {"optimizer": "muon"}})
    assert "optim.optimizer 'adamw' -> 'muon'" in str(e.value) and "\n" not in str(e.value)
    # The same optimizer resumes.
    assert compare_with_checkpoint(tmp_path, record) == []
