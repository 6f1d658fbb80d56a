"""DeepSeek-V3's multi-token prediction (mtp_depth): its loss against one built by hand from the
model's pieces, depth 0 as the model was, gradients into the modules and the shared embedding,
a sharded step against one device, the refusals, what each depth reads under packed documents
and a split sequence, generation without the modules, and the Hugging Face round trip of a
DeepSeek-V3 checkpoint holding them (transformers loading the export where it is at hand)."""

import dataclasses
import functools
import json
import logging
import pathlib
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors import safe_open

from jaxdist.config import DataConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.hf.export import export
from jaxdist.hf.source import Source
from jaxdist.kernels.documents import Documents, from_tokens
from jaxdist.kernels.loss import Vocab
from jaxdist.layout import Layout
from jaxdist.parallel.context import balanced_order
from jaxdist.rules import activation_rules
from jaxdist.step import forward_loss
from meshes.presets import STANDARD_RULES
from models import decode, hf, hf_config
from models.hf_adapter import ADAPTER
from models.inventory import activations, plan_model
from models.mtp import shifted
from models.transformer import Transformer, embed, head_weight, run_layers, run_stacks
from models.transformer_config import TransformerConfig, mtp_block, stacks
from tests.extras import needs_torch_reference, torch_reference
from tests.helpers import DEEPSEEK_ROUTER, compiled_for, mesh_for

FIX = pathlib.Path(__file__).parent / "fixtures" / "hf"

# A tiny DeepSeek-V3: a dense first layer, a MoE layer (every expert run for every token, so
# a shorter sequence routes each token alike), latent attention, two prediction depths.
TINY = TransformerConfig(
    "mtp", "llama", 2, 32, 4, 4, 16, 128, 16, num_experts=4, top_k=2, dense_layers=1,
    dense_d_mlp=40, n_shared_experts=1, moe_impl="dense", scoring="sigmoid", router_bias=True,
    kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    rope_interleave=True, mtp_depth=2,
)  # fmt: skip
TOKENS_BT1 = (jnp.arange(3 * 17).reshape(3, 17) * 37 + 5) % 128


def _run(fn, *args):
    mesh = mesh_for("single")
    with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
        return jax.jit(fn)(*args)


def _losses(c: TransformerConfig, chunk_tokens: int = 0, train: bool = True):
    """(next-token loss, aux) of forward_loss for the model of `c` on TOKENS_BT1 (traced)."""
    model = Transformer(c, nnx.Rngs(0))
    return forward_loss(model, TOKENS_BT1, Vocab(), False, chunk_tokens, train)


def _rms(x_BTD, scale_D, eps):
    return x_BTD * jax.lax.rsqrt(jnp.mean(x_BTD**2, -1, keepdims=True) + eps) * scale_D


# The modules' own weights beside their blocks': the norms and the projection.
OWN = ("enorm_scale_LD", "hnorm_scale_LD", "eh_proj_LID", "head_norm_scale_LD")


def _by_hand(c: TransformerConfig, seed: int = 0):
    """Mean over the depths of their losses, from the model's weights and its trunk and layer
    functions, never through its prediction code: depth k keeps the T - k positions whose
    target exists (causal attention: the later ones never reach them) instead of masking."""
    model = Transformer(c, nnx.Rngs(seed))
    p, T = model.weights(), TOKENS_BT1.shape[1] - 1
    h_BTD, _ = run_stacks(c, p, embed(c, p, TOKENS_BT1[:, :-1]))
    losses = []
    for k in range(1, c.mtp_depth + 1):
        w = {n.removeprefix("mtp_"): v[k - 1] for n, v in p.items() if n.startswith("mtp_")}
        n = T - k
        e_BTD = p["tok_embed_VD"][TOKENS_BT1[:, k : k + n]]
        e_BTD = _rms(e_BTD, w["enorm_scale_LD"], c.norm_eps)
        eh_BTI = jnp.concatenate([e_BTD, _rms(h_BTD[:, :n], w["hnorm_scale_LD"], c.norm_eps)], -1)
        layer = {m: p["mtp_" + m][k - 1 : k] for m in w if m not in OWN}
        h_BTD, _ = run_layers(mtp_block(c), layer, eh_BTI @ w["eh_proj_LID"])
        logits_BTV = _rms(h_BTD, w["head_norm_scale_LD"], c.norm_eps) @ head_weight(c, p)
        targets_BT = TOKENS_BT1[:, k + 1 : k + 1 + n]
        ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
        losses.append(ce_BT.mean())
    return sum(losses) / len(losses)


@pytest.mark.parametrize("chunk_tokens", [0, 8])
def test_the_loss_is_the_hand_built_one(chunk_tokens):
    """The mtp_loss metric is the depths' mean loss; the objective adds lambda times it."""
    no_weight = dataclasses.replace(TINY, mtp_loss_weight=0.0)
    # One program for the four: the hand-built loss, the model's with lambda and without, and
    # the model's evaluation (train=False), which never runs the modules.
    want, (ce, aux), (ce0, aux0), (ce_eval, aux_eval) = _run(
        lambda: (
            _by_hand(TINY),
            _losses(TINY, chunk_tokens),
            _losses(no_weight, chunk_tokens),
            _losses(TINY, chunk_tokens, train=False),
        )
    )
    np.testing.assert_allclose(aux["metrics"]["mtp_loss"], want, rtol=2e-6)
    # lambda 0: the same next-token loss and MoE terms, none of the modules'.
    assert ce == ce0
    np.testing.assert_allclose(aux["loss"] - aux0["loss"], 0.3 * want, rtol=1e-5)
    assert ce_eval == ce and "mtp_loss" not in aux_eval["metrics"]


def test_depth_zero_is_the_model_as_it_was():
    c0 = dataclasses.replace(TINY, mtp_depth=0)
    plain = Transformer(c0, nnx.Rngs(0)).weights()
    ahead = Transformer(TINY, nnx.Rngs(0)).weights()
    assert not [k for k in plain if k.startswith("mtp_")]
    # The modules' weights come after the model's: the model's draw the same random numbers.
    assert list(ahead)[: len(plain)] == list(plain)
    for k, v in plain.items():
        np.testing.assert_array_equal(ahead[k], v, err_msg=k)
    assert c0.num_params() == sum(v.size for v in plain.values())
    assert TINY.num_params() == sum(v.size for v in ahead.values())
    (ce_train, aux_train), (ce_eval, aux_eval), (ce_ahead, _) = _run(
        lambda: (_losses(c0), _losses(c0, train=False), _losses(TINY))
    )
    assert ce_train == ce_eval and aux_train["loss"] == aux_eval["loss"]
    assert "mtp_loss" not in aux_train["metrics"]
    assert ce_ahead == ce_train  # the trunk's own loss, with or without the modules


def test_gradients_reach_the_modules_and_the_shared_embedding():
    def grads(c):
        def loss(model):
            ce, aux = forward_loss(model, TOKENS_BT1, Vocab(), False, 0, True)
            return ce + aux["loss"]

        return nnx.grad(loss)(Transformer(c, nnx.Rngs(0)))

    # Without the MoE terms, which reach the modules' routers whatever lambda is.
    c = dataclasses.replace(TINY, mtp_depth=1, balance_coef=0.0, z_loss_coef=0.0)
    g, g0 = _run(lambda: (grads(c), grads(dataclasses.replace(c, mtp_loss_weight=0.0))))
    flat, flat0 = nnx.to_flat_state(g), dict(nnx.to_flat_state(g0))
    for path, v in flat:
        name = path[0]
        if name.startswith("mtp_") and name != "mtp_expert_bias_LE":  # the bias: no gradient
            assert float(jnp.abs(v[...]).max()) > 0, name
            assert float(jnp.abs(flat0[path][...]).max()) == 0, name
    flat = dict(flat)
    for shared in ("tok_embed_VD", "head_DV", "wo_LNHD", "dense_wq_a_LDR"):
        differ = jnp.abs(flat[(shared,)][...] - flat0[(shared,)][...]).max()
        assert float(differ) > 0, shared
    # Module 1 reads the trunk's state before its final norm, which it never reaches.
    np.testing.assert_array_equal(flat[("norm_f_scale_D",)][...], flat0[("norm_f_scale_D",)][...])


def test_each_depth_reads_its_own_document_and_place():
    inputs_BT = jnp.array([[0, 5, 6, 0, 7, 8, 9, 0]])  # EOS (0) opens each document
    targets_BT = jnp.array([[5, 6, 0, 7, 8, 9, 0, 4]])
    docs = from_tokens(inputs_BT, 0)
    ahead_BT, target_BT, mask_BT = shifted(inputs_BT, targets_BT, docs, 1)
    np.testing.assert_array_equal(ahead_BT, [[5, 6, 0, 7, 8, 9, 0, 4]])
    np.testing.assert_array_equal(target_BT, [[6, 0, 7, 8, 9, 0, 4, 4]])
    # Out where t_{p+1} opens the next document (places 2 and 6) or the row ends (7); the
    # EOS closing a document is still predicted (place 1's target).
    np.testing.assert_array_equal(mask_BT, [[1, 1, 0, 1, 1, 1, 0, 0]])
    # A split sequence (balanced order, places in docs.index_T): the same, reordered.
    order = balanced_order(8, 2)
    placed = Documents(docs.segment_ids_BT[:, order], docs.positions_BT[:, order], order)
    for k in (1, 2):
        want = shifted(inputs_BT, targets_BT, docs, k)
        got = shifted(inputs_BT[:, order], targets_BT[:, order], placed, k)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b[:, order])


def test_remat_covers_the_modules():
    c = dataclasses.replace(TINY, mtp_depth=1, remat="full")
    mesh = mesh_for("single")
    with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
        jaxpr = str(jax.make_jaxpr(lambda: _losses(c))())
    assert jaxpr.count("remat2[") == 3  # the dense stack's layer, the MoE stack's, the module's


def test_generation_runs_without_the_modules():
    model = Transformer(TINY, nnx.Rngs(0))
    p, ids = model.weights(), TOKENS_BT1[:1, :12]
    want = _run(lambda ids: model(ids)[0], ids)
    cache = decode.init_cache(TINY, 1, 16)
    assert not [k for k in cache if "mtp" in k]
    logits, _ = _run(lambda i, k: decode.forward(TINY, p, i, k, 0), ids, cache)
    np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)


def test_the_planner_and_the_flops_count_the_modules():
    c0, c1 = dataclasses.replace(TINY, mtp_depth=0), dataclasses.replace(TINY, mtp_depth=1)
    planned = plan_model(c1)
    assert sum(a.size for a in jax.tree.leaves(planned.abstract_params)) == c1.num_params()
    # A module trains as one more MoE layer (attention included) with the head, and eh_proj.
    layer = dataclasses.replace(stacks(c0)[-1][1], num_layers=1)
    D = c1.d_model
    assert c1.flops_per_token() - c0.flops_per_token() == layer.flops_per_token() + 6 * 2 * D * D
    # Its activations: one more layer's residuals and one more logits, held once.
    a0, a1 = activations(c0, 2), activations(c1, 2)
    assert a1.saved_per_layer == a0.saved_per_layer
    logits = [t.count for t in a1.once if t.logical[-1:] == ("vocab",)]
    assert logits == [2] and len(a1.once) == len(a0.once) + len(a0.saved_per_layer) + 1


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(mtp_depth=-1), r"mtp_depth \(--mtp-depth\) >= 0 .* got mtp_depth -1"),
        (
            dict(mtp_loss_weight=-0.1),
            r"mtp_loss_weight \(--mtp-loss-weight\) >= 0; got .* mtp_loss_weight -0.1",
        ),
        (dict(mtp_loss_weight=float("nan")), r"mtp_loss_weight \(--mtp-loss-weight\) >= 0"),
    ],
)
def test_bad_settings_are_refused_in_one_line(over, match):
    with pytest.raises(ConfigError, match=match) as e:
        dataclasses.replace(TINY, **over)
    assert "\n" not in str(e.value)


def test_gpt2_style_and_pipelines_are_refused():
    with pytest.raises(ConfigError, match="built for llama-style models .* set mtp_depth 0"):
        TransformerConfig("g", "gpt2", 2, 32, 4, 4, 64, 128, 16, mtp_depth=1)
    with pytest.raises(ConfigError, match="pipeline parallelism with multi-token prediction"):
        Transformer(TINY, nnx.Rngs(0)).stages()


# The tiny DeepSeek-V3 of tests/test_dense_layers.py, smaller, with one prediction depth: its
# MoE block moves its own selection bias by its own loads.
SHARDED = dict(
    num_layers=2, d_model=64, d_mlp=32, seq_len=32, dense_layers=1, dense_d_mlp=96,
    **DEEPSEEK_ROUTER, moe_buffer_factor=4.0, num_kv_heads=4, kv_lora_rank=16, q_lora_rank=24,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_interleave=True, mtp_depth=1,
)  # fmt: skip
STEPS = 4


def _train(layout: str):
    mc, _, c = compiled_for(layout, "tiny-moe", steps=STEPS, batch_size=8, **SHARDED)
    data = TokenBatches(DataConfig(batch_size=8), mc.seq_len, mc.vocab_size)
    state, metrics = c.init_fn(), []
    for s in range(STEPS):
        state, m = c.step_fn(state, jax.device_put(data.batch(s), c.batch_sharding))
        metrics.append({k: float(m[k]) for k in ("loss", "mtp_loss", "aux_loss")})
    return metrics, jax.device_get(state.params)


@functools.cache
def _reference():
    return _train("single")


# Experts split, and a sequence split (each depth's tokens looked up by place, in the
# balanced order: models/mtp.py).
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["expert=2,fsdp=4", "context=2,fsdp=4"])
def test_a_sharded_step_equals_one_device(layout):
    ref_metrics, ref = _reference()
    metrics, params = _train(layout)
    for name in ("loss", "mtp_loss", "aux_loss"):
        got, want = [m[name] for m in metrics], [m[name] for m in ref_metrics]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=name)
    assert ref_metrics[-1]["mtp_loss"] < ref_metrics[0]["mtp_loss"]
    assert np.abs(np.asarray(params["mtp_expert_bias_LE"][...])).max() > 0  # moved
    for name in ref:
        np.testing.assert_allclose(
            np.asarray(params[name][...]), np.asarray(ref[name][...]), atol=1e-5, rtol=0,
            err_msg=name,
        )  # fmt: skip


def _tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    with safe_open(str(directory / "model.safetensors"), framework="numpy") as st:
        return {k: st.get_tensor(k) for k in st.keys()}


def _source(model: hf.HFModel, params: dict) -> Source:
    return Source(
        spec=model.spec, params=params, mesh=mesh_for("single"), rules=STANDARD_RULES,
        compute_dtype="float32", vocab_size=model.vocab_size, eos_id=0, tokenizer=None,
        hf_config=model.hf_config, source_dir=model.path, dtype="float32", adapter=ADAPTER,
    )  # fmt: skip


def _loaded(path: pathlib.Path) -> tuple[hf.HFModel, dict]:
    """The directory's model and its weights, read onto one device."""
    model = hf.open_model(path)
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(model.config, nnx.Rngs(0))))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {
        p[0].key: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one)
        for p, a in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    return model, hf.load(model, targets)


def test_a_checkpoint_without_the_modules_loads_without_them(caplog):
    """transformers saves no prediction module (the fixture's config says 1): depth 0, said."""
    hf_config._say_once.cache_clear()  # said once a process: perhaps already, by another test
    with caplog.at_level(logging.WARNING, logger="jaxdist.hf"):
        model = hf.open_model(FIX / "deepseek-v3-moe")
    assert model.config.mtp_depth == 0
    assert hf.read_config(FIX / "deepseek-v3-moe")["num_nextn_predict_layers"] == 1
    [line] = [r.getMessage() for r in caplog.records if "num_nextn" in r.getMessage()]
    assert "weights 0 multi-token prediction modules (model.layers.3.eh_proj" in line
    assert line.endswith("loaded with mtp_depth 0")
    # config.json alone (to plan, or train from scratch): the architecture as it says.
    config, _ = hf.config_from_hf(hf.read_config(FIX / "deepseek-v3-moe"), "x", "x")
    assert config.mtp_depth == 1


def test_a_deepseek_checkpoint_with_its_module_round_trips(tmp_path):
    base, params = _loaded(FIX / "deepseek-v3-moe")
    # The fixture's model with a prediction module of random weights, exported.
    c = dataclasses.replace(base.config, mtp_depth=1)
    fresh = Transformer(c, nnx.Rngs(1)).weights()
    params |= {k: v for k, v in fresh.items() if k.startswith("mtp_")}
    model = base._replace(config=c)
    export(_source(model, params), tmp_path / "out", None, 1 << 30)
    written = _tensors(tmp_path / "out")
    L = c.num_layers  # module 1 is layer L, its block DeepSeek-V3's MoE layer
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head"):
        assert f"model.layers.{L}.{name}.weight" in written, name
    assert written[f"model.layers.{L}.eh_proj.weight"].shape == (32, 64)
    for name in ("self_attn.q_a_proj", "mlp.experts.7.down_proj", "mlp.shared_experts.up_proj"):
        assert f"model.layers.{L}.{name}.weight" in written, name
    assert f"model.layers.{L}.mlp.gate.e_score_correction_bias" in written
    np.testing.assert_array_equal(
        written[f"model.layers.{L}.embed_tokens.weight"], written["model.embed_tokens.weight"]
    )
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    )
    # Read back: the module found in the weights, every parameter as it was written.
    again, loaded = _loaded(tmp_path / "out")
    assert again.config == dataclasses.replace(c, name=again.config.name)
    assert sorted(loaded) == sorted(params)
    for k, v in params.items():
        np.testing.assert_array_equal(np.asarray(loaded[k]), np.asarray(v), err_msg=k)
    # And written again: the same checkpoint, tensor for tensor.
    export(_source(again, loaded), tmp_path / "again", None, 1 << 30)
    rewritten = _tensors(tmp_path / "again")
    assert sorted(rewritten) == sorted(written)
    for k, v in written.items():
        assert rewritten[k].tobytes() == v.tobytes(), k


# transformers loads the export (its unexpected layer-L keys dropped) and gives its logits.
_THEIRS = """
import sys, numpy, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ids = torch.tensor(numpy.load(sys.argv[2]))
with torch.no_grad():
    numpy.save(sys.argv[3], model(ids).logits.numpy())
"""


@needs_torch_reference
def test_transformers_loads_the_export_to_the_same_logits(tmp_path):
    base, params = _loaded(FIX / "deepseek-v3-moe")
    c = dataclasses.replace(base.config, mtp_depth=1, moe_impl="dense")
    params |= {k: v for k, v in Transformer(c, nnx.Rngs(1)).weights().items() if "mtp_" in k}
    model = base._replace(config=c)
    export(_source(model, params), tmp_path / "out", None, 1 << 30)
    ids = (np.arange(2 * 12).reshape(2, 12) * 37 + 3) % 300
    np.save(tmp_path / "ids.npy", ids)
    cmd = [torch_reference(), "-c", _THEIRS, str(tmp_path / "out"), str(tmp_path / "ids.npy")]
    subprocess.run([*cmd, str(tmp_path / "theirs.npy")], check=True, capture_output=True)
    theirs = np.load(tmp_path / "theirs.npy")

    def ours(ids):
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(c, nnx.Rngs(0))))
        state = jax.tree_util.tree_map_with_path(lambda p, _: params[p[0].key], abstract)
        return nnx.merge(graphdef, state)(ids)[0][..., :300]

    np.testing.assert_allclose(_run(ours, jnp.asarray(ids)), theirs, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_train_command_takes_the_depth_and_shows_both_losses(tmp_path, capsys):
    """`--mtp-depth` reaches the model (the run's records carry mtp_loss), the step lines show
    it beside the next-token loss, and a bad value ends in one line naming the flag."""
    from jaxdist.cli.main import main

    # In this process: its 8 fake CPU devices (tests/conftest.py).
    run = ["train", "--model", "tiny-moe", "--mesh", "expert=2,fsdp=4", "--compile-cache", "off"]
    rc = main([*run, "--steps", "2", "--mtp-depth", "1", "--run-dir", str(tmp_path / "r")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    # The step lines are the run's log (stderr); the summary is stdout.
    lines = {int(m[1]): m[0] for m in re.finditer(r"step +(\d+)/2 .*", out.err)}
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "mtp_loss" in r]
    assert len(steps) == 2 and all(np.isfinite(r["mtp_loss"]) for r in steps)
    assert lines and all(f"mtp {r['mtp_loss']:.4f}" in lines[r["step"]] for r in steps), out.err
    rc = main([*run, "--steps", "1", "--mtp-depth", "-1", "--run-dir", str(tmp_path / "bad")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--mtp-depth" in err[0], err
