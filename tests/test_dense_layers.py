"""Dense first layers of a MoE model (DeepSeek-V3's first_k_dense_replace): a dense stack of
their own before the MoE stack, its weights named dense_..., both scanned, remat over both, the
KV cache of both in generation, and both in the parameter count and the planner's view."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import DataConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.layout import Layout
from jaxdist.rules import activation_rules
from meshes.presets import STANDARD_RULES
from models import decode
from models.inventory import activations, plan_model
from models.transformer import Transformer
from models.transformer_config import TransformerConfig, stacks
from tests.helpers import DEEPSEEK_ROUTER, compiled_for, mesh_for

MIXED = TransformerConfig(
    "mixed", "llama", 3, 32, 4, 4, 16, 128, 16, num_experts=4, top_k=2, dense_layers=1,
    dense_d_mlp=40, n_shared_experts=1, moe_impl="dense",
)  # fmt: skip


def _run(fn, *args):
    mesh = mesh_for("single")
    with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
        return jax.jit(fn)(*args)


def test_two_stacks_hold_the_layers_and_every_parameter_is_counted():
    model = Transformer(MIXED, nnx.Rngs(0))
    w = model.weights()
    assert w["dense_w_up_LDF"].shape == (1, 32, 40) and w["dense_wqkv_LDGQH"].shape[0] == 1
    assert w["w_up_LEDF"].shape == (2, 4, 32, 16) and w["shared_w_up_LDF"].shape == (2, 32, 16)
    assert "dense_router_LDE" not in w and "w_up_LDF" not in w
    assert MIXED.num_params() == sum(v.size for v in w.values())
    planned = plan_model(MIXED)
    assert sum(a.size for a in jax.tree.leaves(planned.abstract_params)) == MIXED.num_params()
    # The planner's activations: every layer as one of the mean MLP width.
    mean = (40 + 2 * 16 * 2) // 3
    assert any(a.shape == (2, 16, mean) for a in activations(MIXED, 2).saved_per_layer)


def test_all_moe_and_all_dense_models_keep_one_stack():
    one = dataclasses.replace(MIXED, dense_layers=0, dense_d_mlp=0)
    assert [p for p, _ in stacks(one)] == [""]
    assert not any(k.startswith("dense_") for k in Transformer(one, nnx.Rngs(0)).weights())


def test_cached_generation_runs_both_stacks_as_the_forward_does():
    model = Transformer(MIXED, nnx.Rngs(0))
    p = model.weights()
    ids = (jnp.arange(12)[None] * 7) % 128
    want = _run(lambda ids: model(ids)[0], ids)
    cache = decode.init_cache(MIXED, 1, 16)
    assert cache["dense_k_LBSGH"].shape[0] == 1 and cache["k_LBSGH"].shape[0] == 2
    assert set(decode.decoder(MIXED).cache_logical) == set(cache)
    # The prompt but its last token at once, then the last one from the cache.
    logits, cache = _run(lambda i, k: decode.forward(MIXED, p, i, k, 0), ids[:, :11], cache)
    last, _ = _run(lambda i, k: decode.forward(MIXED, p, i, k, 11), ids[:, 11:], cache)
    got = np.concatenate([logits, last], axis=1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_remat_covers_both_stacks():
    ids = (jnp.arange(12)[None] * 5) % 128

    def grads(c):
        model = Transformer(c, nnx.Rngs(0))
        return nnx.grad(lambda m: jnp.mean(m(ids)[0] ** 2))(model)

    plain = _run(lambda: grads(MIXED))
    full = _run(lambda: grads(dataclasses.replace(MIXED, remat="full")))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(full), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    mesh = mesh_for("single")
    with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
        model = Transformer(MIXED, nnx.Rngs(0))
        jaxpr = str(jax.make_jaxpr(lambda: model(ids)[0])())
    assert jaxpr.count("remat2[") == 2  # one per stack's scanned layer


def test_a_pipeline_over_two_stacks_is_refused():
    with pytest.raises(ConfigError, match="pipeline parallelism over a model with dense first"):
        Transformer(MIXED, nnx.Rngs(0)).stages()


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(dense_layers=3), r"dense_layers 3 must lie in \[0, 3 layers\)"),
        (dict(dense_layers=-1), r"dense_layers -1 must lie in \[0, 3 layers\)"),
        (dict(num_experts=0), "dense_layers 1 .* needs MoE layers"),
        (dict(dense_d_mlp=-2), "dense_d_mlp -2 must be >= 0"),
    ],
)
def test_bad_dense_layer_settings_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(MIXED, **over)


# DeepSeek-V3 at a tiny size: a dense first layer (384 wide) and two MoE layers of 8 experts
# (top 2 of the best 2 of 4 groups, sigmoid scores, a selection bias moved at 0.01 a step, one
# shared expert, scaled by 2.5), latent attention. Dropless, with a receive bound of 4 x the
# balanced share: all the rows four expert devices could send one, so nothing drops.
DEEPSEEK_V3 = dict(
    num_layers=3,
    dense_layers=1,
    dense_d_mlp=384,
    **DEEPSEEK_ROUTER,
    moe_buffer_factor=4.0,
    num_kv_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    rope_interleave=True,
)
TRAIN_STEPS = 20


def _train(layout):
    """TRAIN_STEPS steps of the tiny DeepSeek-V3 on `layout`: (losses, dropped, final params)."""
    mc, _, c = compiled_for(layout, "tiny-moe", steps=TRAIN_STEPS, **DEEPSEEK_V3)
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    state, losses, dropped = c.init_fn(), [], []
    for s in range(TRAIN_STEPS):
        state, m = c.step_fn(state, jax.device_put(data.batch(s), c.batch_sharding))
        losses.append(float(m["loss"]))
        dropped.append(float(m["moe_dropped"]))
    return losses, dropped, jax.device_get(state.params)


@pytest.mark.slow
def test_deepseek_v3_trains_on_expert_and_fsdp_as_on_one_device():
    ref_losses, _, ref = _train("single")
    losses, dropped, params = _train("expert=4,fsdp=2")
    assert "dense_w_gate_LDF" in params and "wkv_b_LCNX" in params and max(dropped) == 0
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
    assert losses[-1] < losses[0]
    # The bias moved, alike on both meshes: it comes from the global loads.
    bias = np.asarray(params["expert_bias_LE"][...])
    assert bias.shape == (2, 8) and np.abs(bias).max() > 0
    for name in ref:
        np.testing.assert_allclose(
            np.asarray(params[name][...]), np.asarray(ref[name][...]), atol=1e-5, rtol=0,
            err_msg=name,
        )  # fmt: skip
