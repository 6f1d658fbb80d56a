"""--fp8 current|delayed: the FP8 projection (jaxdist.kernels.fp8) and its place in the model,
the step and the checkpoint.

The kernel matches a float32 einsum within FP8's error, and every GEMM it runs (forward, dgrad,
wgrad) takes f8 operands, which the quantize-dequantize pattern would not; on the CPU the f8
rounding is real (an emulation, not a pass-through). The delayed state records the amaxes the
test computes itself, the whole batch's over microbatches (their max, not their sum), and a
skipped non-finite step leaves it as it was. The shape filter picks the projections it should.
A short run trains as bf16 does; a delayed run resumes bitwise, and a resume with another --fp8
is refused; TPUs and a pipeline axis are refused in one line."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from rich.console import Console

from jaxdist.checkpoint.interval import CheckpointConfig
from jaxdist.checkpoint.store import restore
from jaxdist.config import DataConfig, LoopConfig, OptimConfig, RunConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.kernels import fp8
from jaxdist.kernels.loss import Vocab, cross_entropy
from jaxdist.layout import Layout, StepConfig
from jaxdist.metrics.records import latest_per_step, read_metrics
from jaxdist.optim import make_optimizer
from jaxdist.rules import activation_rules
from jaxdist.step import build
from jaxdist.train import fit
from meshes.presets import STANDARD_RULES
from models import transformer
from models.layer import PROJECTIONS, norm
from models.presets import get_model_config, model_spec
from models.transformer import Transformer
from tests.helpers import mesh_for

SPEC = "btd,dgh->btgh"  # a projection with a split output, like wqkv's
F8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def _layout(recipe: str, mesh=None, **step) -> Layout:
    mesh = mesh or mesh_for("single")
    return Layout.on(mesh, STANDARD_RULES, StepConfig(fp8=recipe, fp8_filter="none", **step))


def _dots(jaxpr) -> list:
    """Every dot_general of a jaxpr, inside its sub-jaxprs too (custom VJPs, remat, scans)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _dots(inner)
    return found


def _kernel_case():
    x_BTD = jax.random.normal(jax.random.key(0), (4, 16, 64))
    w_DGH = 0.05 * jax.random.normal(jax.random.key(1), (64, 4, 32))
    seed_BTGH = jax.random.normal(jax.random.key(2), (4, 16, 4, 32))
    return x_BTD, w_DGH, seed_BTGH


def _meta_for(x, w, g) -> dict:
    """A delayed state whose histories already hold these tensors' amaxes (a warmed-up run)."""
    amaxes = {"x": jnp.max(jnp.abs(x)), "w": jnp.max(jnp.abs(w)), "g": jnp.max(jnp.abs(g))}
    return {
        **{f"{t}_scale": jnp.ones((1,)) for t in amaxes},
        **{f"{t}_amax": jnp.zeros((16,)).at[3].set(a) for t, a in amaxes.items()},
    }


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_kernel_matches_float32_within_fp8_error_and_every_gemm_takes_f8(recipe):
    x_BTD, w_DGH, seed_BTGH = _kernel_case()
    meta = _meta_for(x_BTD, w_DGH, seed_BTGH) if recipe == "delayed" else None

    def loss(x, w, use_fp8):
        with activation_rules(_layout(recipe if use_fp8 else "off"), mesh_for("single")):
            y = fp8.einsum(SPEC, x, w, meta)
        return jnp.sum(y * seed_BTGH), y  # the output gradient is seed_BTGH

    (_, y), (dx, dw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(x_BTD, w_DGH, True)
    (_, y_ref), (dx_ref, dw_ref) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
        x_BTD, w_DGH, False
    )
    # e4m3 keeps 3 mantissa bits (up to 6% off each operand), e5m2 2 (12%): a few percent
    # over a whole tensor, never nothing.
    for got, want, most in ((y, y_ref, 0.05), (dx, dx_ref, 0.1), (dw, dw_ref, 0.1)):
        error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert 1e-3 < error < most, (recipe, error)
    # Forward, dgrad and wgrad: three GEMMs, every operand f8 (qdq would dot in float32).
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: loss(x, w, True)[0], (0, 1)))(x_BTD, w_DGH)
    dots = _dots(jaxpr.jaxpr)
    assert len(dots) == 3
    assert all(v.aval.dtype in F8 for eqn in dots for v in eqn.invars), dots
    assert sorted(str(v.aval.dtype) for v in dots[0].invars) == ["float8_e4m3fn"] * 2


def test_cpu_rounds_to_f8_for_real():
    # XLA's CPU backend converts the f8 operands to f32 before multiplying: the result is the
    # f32 product of the f8-rounded operands, exactly (an honest emulation, not a pass-through).
    x_BTD, w_DGH, _ = _kernel_case()
    with activation_rules(_layout("current"), mesh_for("single")):
        y = jax.jit(lambda x, w: fp8.einsum(SPEC, x, w))(x_BTD, w_DGH)
    sx, sw = (float(fp8.own_scale(a, jnp.float8_e4m3fn)) for a in (x_BTD, w_DGH))
    q = lambda a, s: (np.asarray(a) / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # noqa: E731
    want = np.einsum(SPEC, q(x_BTD, sx), q(w_DGH, sw)) * sx * sw
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(y), np.einsum(SPEC, x_BTD, w_DGH), rtol=1e-3)


# --- The step -------------------------------------------------------------------------------

# One program per recipe for every test below (the training runs, the amaxes, the resume): the
# tiny model in bfloat16 on rows of 32 tokens, batch 8 in 2 microbatches, one device, step 1
# made NaN (all recipes skip it alike), warmup 2 then cosine over 30 steps whatever the run's
# length.
SEQ, BATCH, STEPS = 32, 8, 30
OPTIM = OptimConfig(warmup_steps=2, decay_steps=STEPS)


def _step(recipe: str) -> StepConfig:
    return StepConfig(2, fp8=recipe, fp8_filter="none", fp8_history=4, fault_nan_steps=(1,))


@functools.cache
def _built(recipe: str):
    mc = get_model_config("tiny", seq_len=SEQ, compute_dtype="bfloat16")
    mesh = mesh_for("single")
    layout = Layout.on(mesh, STANDARD_RULES, _step(recipe), batch_size=BATCH, seq_len=SEQ)
    tx, lr = make_optimizer(OPTIM, STEPS)
    return mc, layout, build(model_spec(mc).init, tx, lr, layout, mesh, vocab=Vocab(256))


@functools.cache
def _trained(recipe: str):
    """STEPS steps: the losses, the first state and the states after steps 0, 1 and 2."""
    mc, _, jitted = _built(recipe)
    data = TokenBatches(DataConfig(batch_size=BATCH), SEQ, mc.vocab_size)
    state = jitted.init_fn()
    states, losses = [jax.device_get(state)], []
    for s in range(STEPS):
        state, metrics = jitted.step_fn(state, jax.device_put(data.batch(s), jitted.batch_sharding))
        losses.append(float(metrics["loss"]))
        if s < 3:
            states.append(jax.device_get(state))
    return np.array(losses), states, data.batch(0)


def _observed(mc, layout, first, tokens_BT1, M: int) -> dict[tuple, float]:
    """The amaxes step 0 sees, computed here, by (weight, tensor, layer): layer 0's QKV input
    (the whole batch's), every weight's, and the last layer's down-projection output gradient
    (the max over the microbatches of each microbatch's mean loss's gradient; its sum too)."""
    p = {k: v[...] for k, v in first.params.items()}
    fp8_state = {k: v[...] for k, v in first.fp8.items()}

    @jax.jit
    def amaxes(p, fp8_state, tokens_BT1):
        inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
        with activation_rules(layout, mesh_for("single")):
            x_BTD = transformer.embed(mc, p, inputs_BT)
            norm1 = [transformer._compute(mc, p[k][0]) for k in ("norm1_scale_LD", "norm1_bias_LD")]
            h_BTD = norm(mc, x_BTD, *norm1)
            out_BTD, _ = transformer.run_layers(mc, transformer._layers(p), x_BTD, None, fp8_state)
            ce = lambda x, t: cross_entropy(transformer.logits(mc, p, x), t)  # noqa: E731
            g = [jax.grad(ce)(out_BTD[m::M], targets_BT[m::M]) for m in range(M)]
        return jnp.max(jnp.abs(h_BTD)), jnp.stack([jnp.max(jnp.abs(g_m)) for g_m in g])

    h_amax, g_amaxes = (np.asarray(a) for a in amaxes(p, fp8_state, tokens_BT1))
    observed = {("wqkv_LDGQH", "x", 0): float(h_amax)}
    observed[("w_down_LFD", "g", mc.num_layers - 1)] = float(g_amaxes.max())
    for weight in PROJECTIONS:
        for layer in range(mc.num_layers if weight in p else 0):
            w = transformer._compute(mc, p[weight][layer])  # as the GEMM takes it
            observed[(weight, "w", layer)] = float(jnp.max(jnp.abs(w)))
    return observed, float(g_amaxes.sum())


def test_delayed_state_records_the_amaxes_and_a_skipped_step_keeps_it():
    mc, layout, _ = _built("delayed")
    _, (first, *states), batch = _trained("delayed")
    want, g_sum = _observed(mc, layout, first, batch, 2)
    after = {k: np.asarray(v[...]) for k, v in states[0].fp8.items()}
    for (weight, tensor, layer), value in want.items():
        history = after[fp8.meta_name(weight, tensor, "amax")][layer]
        # The newest amax first (Flax's order); the rest of the history still empty.
        np.testing.assert_allclose(history[0], value, rtol=1e-2, err_msg=f"{weight} {tensor}")
        assert not history[1:].any()
    # The scales step 0 used came from the empty history: 1, as Flax starts.
    assert all((v == 1.0).all() for k, v in after.items() if "scale" in k)
    # Over the 2 microbatches the max, where a sum would be nearly twice it.
    g_last = after[fp8.meta_name("w_down_LFD", "g", "amax")][mc.num_layers - 1][0]
    assert g_sum > 1.3 * g_last
    # Step 1 was NaN and skipped: its state is step 0's, bit for bit; step 2 scales by the
    # history step 0 left (amax / 448 for e4m3, / 57344 for e5m2).
    for k, v in states[0].fp8.items():
        np.testing.assert_array_equal(np.asarray(states[1].fp8[k][...]), np.asarray(v[...]))
    x_scale = states[2].fp8[fp8.meta_name("wqkv_LDGQH", "x", "scale")][...][0, 0]
    x_amax = after[fp8.meta_name("wqkv_LDGQH", "x", "amax")][0][0]
    np.testing.assert_allclose(float(x_scale), x_amax / 448, rtol=1e-6)
    g_scale = states[2].fp8[fp8.meta_name("w_down_LFD", "g", "scale")][...][-1, 0]
    np.testing.assert_allclose(float(g_scale), g_last / 57344, rtol=1e-6)


def test_the_fp8_state_is_no_weight():
    # The optimizer's state (and with it the clipping norm, weight decay and Muon's labels)
    # covers the parameters alone: the same tree as without FP8.
    delayed, off = _built("delayed")[2], _built("off")[2]
    same = jax.tree.structure(delayed.abstract_state.opt_state)
    assert same == jax.tree.structure(off.abstract_state.opt_state)
    assert off.abstract_state.fp8 is None and delayed.num_params == off.num_params
    # tiny is GPT-2 style (no gate): 4 projections x 3 tensors x (scale, history).
    assert len(jax.tree.leaves(delayed.abstract_state.fp8)) == 4 * 3 * 2


def test_short_runs_train_as_the_compute_dtype_does():
    off = _trained("off")[0]
    assert np.isnan(off[1]) and off[-5:].mean() < off[0] - 1  # it learns; step 1 skipped
    for recipe in ("current", "delayed"):
        losses = _trained(recipe)[0]
        assert np.isfinite(np.delete(losses, 1)).all(), recipe
        gap = abs(losses[-5:].mean() / off[-5:].mean() - 1)
        assert gap < 0.02, (recipe, losses[-5:], off[-5:])


# --- The shape filter -----------------------------------------------------------------------


@pytest.mark.parametrize("fp8_filter", ["auto", "none"])
def test_shape_filter_takes_the_projections_worth_it(fp8_filter):
    # d_mlp 4160 puts the MLP past torchao's crossover (d_out > 4096, or d_in > 1024 for the
    # down projection); the attention projections (128 -> 384, 128 -> 128) stay below it.
    mc = get_model_config("tiny-llama", d_mlp=4160, num_layers=1, seq_len=16)
    mesh = mesh_for("single")
    step = StepConfig(fp8="delayed", fp8_filter=fp8_filter)
    layout = Layout.on(mesh, STANDARD_RULES, step, batch_size=2, seq_len=16)

    def forward(tokens_BT):
        with activation_rules(layout, mesh):
            model = Transformer(mc, nnx.Rngs(0))
            return model(tokens_BT)[0], model.fp8_state()

    tokens_BT = jnp.zeros((2, 16), jnp.int32)
    held = {k[len(fp8.PREFIX) :].rsplit("_", 3)[0] for k in jax.eval_shape(forward, tokens_BT)[1]}
    dots = _dots(jax.make_jaxpr(forward)(tokens_BT).jaxpr)
    f8_dots = [e for e in dots if e.invars[0].aval.dtype in F8]
    picked = {"w_up", "w_gate", "w_down"} | ({"wqkv", "wo"} if fp8_filter == "none" else set())
    assert held == picked
    assert len(f8_dots) == len(picked)
    assert fp8.fans("btd,dgqh->btgqh", (128, 2, 4, 32)) == (128, 256)


@pytest.mark.parametrize("d_mlp, runs", [(512, 0), (4160, 3)])
def test_the_run_says_how_many_projections_run_in_fp8_and_why_not_the_others(capsys, d_mlp, runs):
    # `--fp8 current` on a model whose projections are all too small changed nothing (losses
    # bit-identical) while a note spoke of FP8. The line counts what the model runs in FP8, by
    # its own rule: the f8 dots of its forward, one per projection.
    from jaxdist.cli.cmd_train import Train
    from jaxdist.cli.options import setup

    args = Train(model="tiny-llama", d_mlp=d_mlp, layers=1, seq_len=16, devices="cpu:8")
    args = dataclasses.replace(args, step=StepConfig(fp8="current"), compile_cache="off")
    capsys.readouterr()
    mesh, layout, mc, _ = setup(args)
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("fp8:")]
    assert f"runs {runs} of the 5 projections of each of tiny-llama's layers in FP8" in line
    # The CPU's emulation note only where something runs in FP8 (it spoke with none).
    assert ("note: --fp8 current on cpu: the projections in FP8 are emulated" in err) == (runs > 0)

    def forward(tokens_BT):
        with activation_rules(layout, mesh):
            return Transformer(mc, nnx.Rngs(0))(tokens_BT)[0]

    jaxpr = jax.make_jaxpr(forward)(jnp.zeros((2, 16), jnp.int32)).jaxpr
    assert len([e for e in _dots(jaxpr) if e.invars[0].aval.dtype in F8]) == runs
    # Why the others stay in the compute dtype, each shape named; with none in FP8, that the
    # step is unchanged and how to force it.
    assert "too small to gain" in line and "128->256, 128->128" in line  # wqkv: q 128, k and v 64
    assert ("the step is the compute dtype's, unchanged" in line) == (runs == 0)
    assert "--fp8-filter none" in line or runs


# --- Resume ---------------------------------------------------------------------------------


def _fit(run_dir, steps: int, recipe: str = "delayed") -> dict:
    mc = _built(recipe)[0]
    config = RunConfig(
        optim=OPTIM,
        data=DataConfig(batch_size=BATCH),
        step=_step(recipe),
        loop=LoopConfig(steps, 1, run_dir=str(run_dir)),
        checkpoint=CheckpointConfig(every="4"),
    )
    return fit(model_spec(mc), mesh_for("single"), STANDARD_RULES, config, Console(quiet=True))


def _losses_and_state(run_dir):
    records = latest_per_step(read_metrics(run_dir / "metrics.jsonl"))
    losses = {s: r["loss"] for s, r in records.items()}
    restored = restore(run_dir, _built("delayed")[2].abstract_state)
    return losses, jax.device_get(restored.state)


def test_delayed_run_resumes_bitwise_and_refuses_another_recipe(tmp_path):
    _fit(tmp_path / "whole", 8)
    _fit(tmp_path / "cut", 5)  # stops after step 4 (saved), resumed below
    with pytest.raises(ConfigError, match=r"step\.fp8 'delayed' -> 'current'"):
        _fit(tmp_path / "cut", 8, "current")
    _fit(tmp_path / "cut", 8)
    (whole, whole_state), (cut, cut_state) = (
        _losses_and_state(tmp_path / name) for name in ("whole", "cut")
    )
    assert sorted(cut) == list(range(8)) and int(cut_state.step) == 8
    for s in range(5, 8):  # the resumed steps: bit for bit
        assert cut[s] == whole[s], s
    for a, b in zip(jax.tree.leaves(cut_state), jax.tree.leaves(whole_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert cut_state.fp8 is not None


# --- Refusals -------------------------------------------------------------------------------


def _fake_mesh(platform: str, kind: str, **more):
    device = types.SimpleNamespace(platform=platform, device_kind=kind, **more)
    return types.SimpleNamespace(devices=np.array([device]))


def test_hardware_without_fp8_units_and_pipelines_are_refused_in_one_line():
    layout = _layout("current")
    for kind in ("TPU v5p", "TPU v5 lite", "TPU v4", "TPU v6 lite"):
        with pytest.raises(ConfigError, match="no FP8 matrix units") as e:
            fp8.check(layout, _fake_mesh("tpu", kind))
        assert "\n" not in str(e.value) and kind in str(e.value)
    with pytest.raises(ConfigError, match="compute capability 8.0"):
        fp8.check(layout, _fake_mesh("gpu", "NVIDIA A100", compute_capability="8.0"))
    fp8.check(layout, _fake_mesh("gpu", "NVIDIA H100", compute_capability="9.0"))
    assert "emulated" in fp8.platform_note(layout, _fake_mesh("cpu", "cpu"))
    # A pipeline: refused before anything is traced.
    mc = get_model_config("tiny", seq_len=SEQ)
    mesh = mesh_for("pipeline=2,data=4")
    step = StepConfig(2, fp8="delayed")
    piped = Layout.on(mesh, STANDARD_RULES, step, batch_size=BATCH, seq_len=SEQ)
    tx, lr = make_optimizer(OPTIM, STEPS)
    with pytest.raises(ConfigError, match="pipeline=2: the stages run in a shard_map") as e:
        build(model_spec(mc).init, tx, lr, piped, mesh)
    assert "\n" not in str(e.value) and "--fp8 off" in str(e.value)


@pytest.mark.experiment  # a third compile (replica groups): beyond the suite's minute
def test_replica_groups_keep_their_own_fp8_state():
    # Each group keeps an FP8 state of its own ([M, ...]) whose amaxes are its own batches'
    # (DiLoCo: nothing crosses `replica` between syncs); the outer step runs beside it.
    from jaxdist.layout import SyncConfig

    mc = _built("delayed")[0]
    mesh = mesh_for("replica=2,fsdp=4")
    layout = Layout.on(
        mesh, STANDARD_RULES, _step("delayed"), batch_size=BATCH * 2, seq_len=SEQ,
        sync=SyncConfig(sync_every=2),
    )  # fmt: skip
    tx, lr = make_optimizer(OPTIM, STEPS)
    jitted = build(model_spec(mc).init, tx, lr, layout, mesh, vocab=Vocab(256))
    data = TokenBatches(DataConfig(batch_size=BATCH * 2), SEQ, mc.vocab_size)
    state = jitted.init_fn()
    for s in (0, 1):  # step 1 is NaN (skipped) and ends the first round: the outer step
        batch = jax.device_put(data.batch(2 * s), jitted.batch_sharding)
        state, _ = jitted.step_fn(state, batch, jitted.outer_part(s))
    x_amax_M = np.asarray(state.fp8[fp8.meta_name("wqkv_LDGQH", "x", "amax")][...])[:, 0, 0]
    w_amax_M = np.asarray(state.fp8[fp8.meta_name("wqkv_LDGQH", "w", "amax")][...])[:, 0, 0]
    assert x_amax_M.shape == (2,) and x_amax_M[0] != x_amax_M[1]  # the groups' own rows
    assert w_amax_M[0] == w_amax_M[1]  # the same weights at the start
    assert state.outer is not None and len(jax.tree.leaves(state.outer)) == 2 * len(
        jax.tree.leaves(state.params)
    )
