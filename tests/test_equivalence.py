"""A sharded step gives the single-device result, and state is sharded as the rules say."""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from jaxdist.data import DataConfig, TokenBatches
from jaxdist.rules import activation_rules
from jaxdist.step import cross_entropy
from meshes.presets import STANDARD_RULES
from tests.helpers import compiled_for

STEPS = 4
SLOW = pytest.mark.slow  # the quick loop (-m "not slow") keeps data=2,fsdp=2,tensor=2
LAYOUTS = [
    pytest.param("data=8", marks=SLOW),
    pytest.param("fsdp=8", marks=SLOW),
    pytest.param("data=2,tensor=4", marks=SLOW),
    "data=2,fsdp=2,tensor=2",
]


def _grads(jitted, mesh, graphdef, state, batch):
    def loss_fn(params, tokens):
        return cross_entropy(nnx.merge(graphdef, params)(tokens[:, :-1])[0], tokens[:, 1:])

    @functools.partial(jax.jit, out_shardings=jitted.state_sharding.params)
    def grads(params, tokens):
        with activation_rules(STANDARD_RULES, mesh):
            return jax.grad(loss_fn)(params, tokens)

    return jax.device_get(grads(state.params, batch))


def _run(layout, model="tiny", microbatches=1, overrides=()):
    mc, mesh, jitted = compiled_for(
        layout, model, microbatches=microbatches, steps=STEPS, **dict(overrides)
    )
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    from models.transformer import Transformer

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(mc, nnx.Rngs(0))))
    state = jitted.init_fn()
    first = jax.device_put(data.batch(0), jitted.batch_sharding)
    grads0 = _grads(jitted, mesh, graphdef, state, first)
    losses = []
    for s in range(STEPS):
        batch = jax.device_put(data.batch(s), jitted.batch_sharding)
        state, metrics = jitted.step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return mesh, jitted, state, losses, grads0


@functools.cache
def _reference(model, microbatches=1, overrides=()):
    _, _, _, state, losses, grads0 = (None, *_run("single", model, microbatches, overrides))
    return jax.device_get(state.params), losses, grads0


def _assert_close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_matches_single_device(layout):
    ref_params, ref_losses, ref_grads = _reference("tiny")
    mesh, jitted, state, losses, grads0 = _run(layout)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]  # it learns
    _assert_close(grads0, ref_grads, rtol=1e-4, atol=1e-6)
    _assert_close(jax.device_get(state.params), ref_params, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_llama_variant_and_accumulation_match_single_device():
    ref_params, ref_losses, ref_grads = _reference("tiny-llama", microbatches=2)
    _, _, state, losses, grads0 = _run("fsdp=4,tensor=2", "tiny-llama", microbatches=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_close(grads0, ref_grads, rtol=1e-4, atol=1e-6)
    _assert_close(jax.device_get(state.params), ref_params, rtol=1e-4, atol=1e-5)


# What Hugging Face's GPT-2 and Llama variants need (models/hf.py): linear biases, a head tied
# to the embedding. The tied weight's gradient is the sum of its two uses, on every layout.
@pytest.mark.parametrize("model", ["tiny", pytest.param("tiny-llama", marks=SLOW)])
def test_biases_and_tied_embeddings_match_single_device(model):
    overrides = (("attention_bias", True), ("mlp_bias", True), ("tie_embeddings", True))
    ref_params, ref_losses, ref_grads = _reference(model, overrides=overrides)
    _, _, state, losses, grads0 = _run("data=2,fsdp=2,tensor=2", model, overrides=overrides)
    assert "head_DV" not in ref_params and "bias_qkv_LGQH" in ref_params
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(ref_grads["bias_o_LD"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    _assert_close(grads0, ref_grads, rtol=1e-4, atol=1e-6)
    _assert_close(jax.device_get(state.params), ref_params, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_accumulation_equals_one_big_batch():
    # Two microbatches of 8 rows are the same step as one batch of 16 (mean of means).
    _, one_losses, _ = _reference("tiny", microbatches=1)
    _, two_losses, _ = _reference("tiny", microbatches=2)
    np.testing.assert_allclose(two_losses, one_losses, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data=2,fsdp=2,tensor=2", "fsdp=8"])
def test_params_and_optimizer_state_are_sharded_by_the_rules(layout):
    mesh, jitted, state, _, _ = _run(layout)
    params = state.params
    expect = {
        "wqkv_LDGQH": STANDARD_RULES.spec(
            ("layers", "embed", "kv_heads", "qkv", "head_dim"), "param"
        ),
        "w_up_LDF": STANDARD_RULES.spec(("layers", "embed", "mlp"), "param"),
        "w_down_LFD": STANDARD_RULES.spec(("layers", "mlp", "embed"), "param"),
        "tok_embed_VD": STANDARD_RULES.spec(("vocab", "embed"), "param"),
        "head_DV": STANDARD_RULES.spec(("embed", "vocab"), "param"),
    }
    for name, spec in expect.items():
        arr = params[name][...]
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), name
        # Each device really holds a 1/ways slice, not a full copy.
        ways = 1
        for axes in spec:
            for a in (axes,) if isinstance(axes, str) else axes or ():
                ways *= mesh.shape[a]
        shard = arr.addressable_shards[0].data
        assert shard.size * ways == arr.size, name
    adam = [
        s
        for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
        if isinstance(s, optax.ScaleByAdamState)
    ][0]
    for moment in (adam.mu, adam.nu):
        for name, spec in expect.items():
            arr = moment[name][...]
            assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), name
