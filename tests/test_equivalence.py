"""A sharded step gives the single-device result, and state is sharded as the rules say.

Compiling is most of the cost here (a layout's init and step: ~15 s of CPU), so every run is
made once per module and shared by the tests that assert on it, and each layout stands for one
mechanism: pure FSDP parallelism, data, FSDP and tensor at once (the default layout, in the
quick loop), tensor=4 with biases and a tied head, Llama with accumulation under FSDP+tensor."""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from jaxdist.config import DataConfig, OptimConfig
from jaxdist.data import TokenBatches
from meshes.presets import STANDARD_RULES
from tests.helpers import compiled_for

STEPS = 4
SLOW = pytest.mark.slow  # the quick loop (-m "not slow") keeps data=2,fsdp=2,tensor=2
# What Hugging Face's GPT-2 and Llama variants need (models/hf.py): linear biases, a head tied
# to the embedding. The tied weight's gradient is the sum of its two uses, on every layout.
HF_VARIANT = (("attention_bias", True), ("mlp_bias", True), ("tie_embeddings", True))


def _adam(opt_state) -> optax.ScaleByAdamState:
    return [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))
        if isinstance(s, optax.ScaleByAdamState)
    ][0]


def _first_gradients(state, grad_norm: float):
    """The first step's gradients, read back from the state it returned, so no second program
    is compiled for them: Adam's first moment is then (1 - b1) g', g' the gradient clipped to
    global norm `clip_norm` (g * clip_norm / |g| above it); |g| is the step's `grad_norm`.
    A gradient wrong by any factor, or in any element, still shows (the scale is undone with
    each run's own norm). OptimConfig(): the b1 and clip_norm tests.helpers' optimizer uses."""
    config = OptimConfig()
    unclip = max(1.0, grad_norm / config.clip_norm)
    mu = jax.device_get(_adam(state.opt_state).mu)
    return jax.tree.map(lambda m: np.asarray(m) * unclip / (1 - config.b1), mu)


@functools.cache
def _run(layout, model="tiny", microbatches=1, overrides=()):
    """STEPS steps on `layout` ("single": one device), made once per module: (mesh, final
    state, losses, the first step's gradients)."""
    mc, mesh, jitted = compiled_for(
        layout, model, microbatches=microbatches, steps=STEPS, **dict(overrides)
    )
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    state = jitted.init_fn()
    losses, grads0 = [], None
    for s in range(STEPS):
        batch = jax.device_put(data.batch(s), jitted.batch_sharding)
        state, metrics = jitted.step_fn(state, batch)
        losses.append(float(metrics["loss"]))
        if s == 0:  # before the next step donates this state
            grads0 = _first_gradients(state, float(metrics["grad_norm"]))
    return mesh, state, losses, grads0


def _assert_close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _assert_matches(run, reference):
    _, state, losses, grads0 = run
    _, ref_state, ref_losses, ref_grads = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]  # it learns
    _assert_close(grads0, ref_grads, rtol=1e-4, atol=1e-6)
    _assert_close(jax.device_get(state.params), jax.device_get(ref_state.params), 1e-4, 1e-5)


# No data=8 case: a data axis is the same code in every layout (the batch split over it, the
# weights replicated along it, their gradients summed over it by XLA), run here beside fsdp and
# tensor by the default layout; its own case compiled one more step and init for nothing new.
# fsdp=8 stays: the sharding test below reads its 1/8 shards.
@pytest.mark.parametrize("layout", [pytest.param("fsdp=8", marks=SLOW), "data=2,fsdp=2,tensor=2"])
def test_sharded_matches_single_device(layout):
    _assert_matches(_run(layout), _run("single"))


@SLOW
def test_biases_and_tied_embeddings_match_single_device():
    # tensor=4: each device holds one head's QKV biases and a quarter of the tied vocabulary.
    reference = _run("single", overrides=HF_VARIANT)
    ref_params, ref_grads = reference[1].params, reference[3]
    assert "head_DV" not in ref_params and "bias_qkv_LGQH" in ref_params
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(ref_grads["bias_o_LD"]))
    _assert_matches(_run("data=2,tensor=4", overrides=HF_VARIANT), reference)


@SLOW
def test_llama_variant_with_accumulation_equals_one_big_batch():
    # Two microbatches of 8 rows under FSDP and tensor parallelism are the same step as one
    # batch of 16 on one device (mean of means); Llama style (RoPE, GQA, SwiGLU) with the
    # Hugging Face variant's biases and tied head.
    reference = _run("single", "tiny-llama", overrides=HF_VARIANT)
    assert "bias_gate_LF" in reference[1].params
    _assert_matches(_run("fsdp=4,tensor=2", "tiny-llama", 2, HF_VARIANT), reference)


# DeepSeek-style latent attention (models/mla.py) on tiny-llama: q through rank 48, a kv latent
# of 32, RoPE parts of 16 (interleaved), values of 24 against q.k's 32; one kv head per head.
MLA = (
    ("num_kv_heads", 4),
    ("kv_lora_rank", 32),
    ("q_lora_rank", 48),
    ("qk_nope_head_dim", 16),
    ("qk_rope_head_dim", 16),
    ("v_head_dim", 24),
    ("rope_interleave", True),
)


# Heads split over tensor two and four ways (one a device), the ranks' storage over fsdp.
@pytest.mark.parametrize(
    "layout", ["data=2,fsdp=2,tensor=2", pytest.param("data=2,tensor=4", marks=SLOW)]
)
def test_latent_attention_matches_single_device(layout):
    reference = _run("single", "tiny-llama", overrides=MLA)
    assert "wq_b_LRNU" in reference[1].params and "wqkv_LDGQH" not in reference[1].params
    _assert_matches(_run(layout, "tiny-llama", overrides=MLA), reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data=2,fsdp=2,tensor=2", "fsdp=8"])
def test_params_and_optimizer_state_are_sharded_by_the_rules(layout):
    mesh, state, _, _ = _run(layout)
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
    adam = _adam(state.opt_state)
    for moment in (adam.mu, adam.nu):
        for name, spec in expect.items():
            arr = moment[name][...]
            assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), name
