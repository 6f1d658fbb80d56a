"""The router's rules (models/routing.py) against hand-worked cases and a numpy reference, the
aux-loss-free bias (jaxdist.optim): its sign rule, a sharded run equal to one device's,
its checkpoint; and the settings refused in one line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.checkpoint.store import Checkpointer, param_shapes
from jaxdist.config import DataConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.optim import moved
from models.presets import get_model_config
from models.routing import route
from tests.helpers import DEEPSEEK_ROUTER, compiled_for

# DeepSeek-V3's router at a tiny size (tests.helpers.DEEPSEEK_ROUTER). Capacity E/K drops
# nothing, so a sharded run computes what one device does.
DEEPSEEK = dict(**DEEPSEEK_ROUTER, capacity_factor=4.0)
STEPS = 3


def _config(**over):
    return get_model_config("tiny-moe", **{"num_experts": 8, "top_k": 3, **over})


def _route(c, scores_E, bias_E=None):
    """(experts, weights) of one token whose sigmoid scores are `scores_E`, sorted by expert."""
    logits = jnp.asarray(np.log(scores_E / (1 - scores_E)), jnp.float32)[None, None]
    bias = None if bias_E is None else jnp.asarray(bias_E, jnp.float32)
    _, expert_BTK, weight_BTK = route(c, logits, bias)
    e, w = np.asarray(expert_BTK)[0, 0], np.asarray(weight_BTK)[0, 0]
    return e[np.argsort(e)], w[np.argsort(e)]


SCORES = np.array([0.9, 0.1, 0.5, 0.5, 0.8, 0.7, 0.2, 0.95])


def test_group_limited_choice_by_hand():
    # Groups (0,1) (2,3) (4,5) (6,7) score the sum of their top two: 1.0, 1.0, 1.5, 1.15; the
    # best two are the last two, so expert 0 (0.9, second best of all) is out of reach.
    c = _config(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    experts, weights = _route(c, SCORES)
    assert experts.tolist() == [4, 5, 7]
    np.testing.assert_allclose(weights, np.array([0.8, 0.7, 0.95]) / 2.45 * 2.5, rtol=1e-5)
    # Without groups expert 0 is chosen; without renormalizing the weights are the scores.
    c = _config(scoring="sigmoid", moe_renormalize=False)
    experts, weights = _route(c, SCORES)
    assert experts.tolist() == [0, 4, 7]
    np.testing.assert_allclose(weights, [0.9, 0.8, 0.95], rtol=1e-5)


def test_bias_moves_the_choice_but_not_the_weights():
    c = _config(scoring="sigmoid", n_group=4, topk_group=2, router_bias=True)
    bias = np.zeros(8)
    bias[6] = 0.65  # expert 6 chooses at 0.85: above expert 5's 0.7, below 4's 0.8
    experts, weights = _route(c, SCORES, bias)
    assert experts.tolist() == [4, 6, 7]
    # Its weight is its score, 0.2, not 0.85.
    np.testing.assert_allclose(weights, np.array([0.8, 0.2, 0.95]) / 1.95, rtol=1e-5)


def _numpy_route(scores_NE, groups, keep, K, bias_E, renorm, scale):
    """DeepSeek-V3's router as transformers writes it, in numpy, one token at a time."""
    out = []
    for s_E in scores_NE:
        choice_E = s_E + bias_E
        group_G = np.sort(choice_E.reshape(groups, -1), axis=-1)[:, -2:].sum(-1)
        kept_G = np.zeros(groups, bool)
        kept_G[np.argsort(-group_G, kind="stable")[:keep]] = True
        choice_E = np.where(np.repeat(kept_G, len(s_E) // groups), choice_E, -np.inf)
        e_K = np.argsort(-choice_E, kind="stable")[:K]
        w_K = s_E[e_K] / (s_E[e_K].sum() if renorm else 1.0) * scale
        mix_E = np.zeros_like(s_E)
        mix_E[e_K] = w_K
        out.append(mix_E)
    return np.stack(out)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_router_equals_a_numpy_reference(scoring):
    rng = np.random.default_rng(0)
    E, K, G, keep = 16, 4, 4, 2
    c = _config(
        num_experts=E,
        top_k=K,
        scoring=scoring,
        n_group=G,
        topk_group=keep,
        router_bias=True,
        routed_scaling_factor=1.5,
    )
    logits = rng.normal(size=(2, 5, E)).astype(np.float32)
    bias = (0.1 * rng.normal(size=E)).astype(np.float32)
    _, expert_BTK, weight_BTK = route(c, jnp.asarray(logits), jnp.asarray(bias))
    mix = np.zeros((10, E), np.float32)
    np.put_along_axis(
        mix, np.asarray(expert_BTK).reshape(10, K), np.asarray(weight_BTK).reshape(10, K), -1
    )
    x = logits.reshape(10, E).astype(np.float64)
    if scoring == "sigmoid":
        scores = 1 / (1 + np.exp(-x))
    else:
        scores = np.exp(x - x.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    np.testing.assert_allclose(
        mix, _numpy_route(scores, G, keep, K, bias, True, 1.5), rtol=1e-5, atol=1e-7
    )


def test_the_bias_moves_by_the_sign_rule():
    bias_LE = jnp.zeros((2, 4))
    load_LE = jnp.asarray([[10.0, 2.0, 4.0, 0.0], [4.0, 4.0, 4.0, 4.0]])  # means 4 and 4
    np.testing.assert_allclose(
        np.asarray(moved(bias_LE, load_LE, 0.001)),
        [[-0.001, 0.001, 0.0, 0.001], [0.0, 0.0, 0.0, 0.0]],
    )


@functools.cache
def _run(layout):
    """STEPS steps of the DeepSeek-style tiny MoE on `layout`: (losses, final state)."""
    mc, _, c = compiled_for(layout, "tiny-moe", steps=10, **DEEPSEEK)
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    state, losses = c.init_fn(), []
    for s in range(STEPS):
        state, m = c.step_fn(state, jax.device_put(data.batch(s), c.batch_sharding))
        losses.append(float(m["loss"]))
    return losses, state, c, data


def test_sharded_deepseek_router_equals_one_device():
    ref_losses, ref_state, _, _ = _run("single")
    losses, state, _, _ = _run("expert=4,fsdp=2")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    bias = np.asarray(jax.device_get(state.params["expert_bias_LE"][...]))
    # The bias moved (0.01 a step), the same on both meshes: it comes from global loads.
    assert np.abs(bias).max() > 0
    np.testing.assert_array_equal(bias, jax.device_get(ref_state.params["expert_bias_LE"][...]))
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)),
        jax.tree.leaves(jax.device_get(ref_state.params)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_the_bias_is_checkpointed_and_a_resume_moves_it_alike(tmp_path):
    _, state, c, data = _run("single")
    ck = Checkpointer(tmp_path)
    ck.save(STEPS, state, {"param_shapes": param_shapes(c.abstract_state.params), "mesh": {}})
    ck.close()
    restored = Checkpointer(tmp_path).restore_latest(
        c.abstract_state, param_shapes(c.abstract_state.params)
    )
    bias = lambda s: np.asarray(jax.device_get(s.params["expert_bias_LE"][...]))  # noqa: E731
    np.testing.assert_array_equal(bias(restored.state), bias(state))
    batch = jax.device_put(data.batch(STEPS), c.batch_sharding)
    # One more step from each: the same bias (the donated originals are copies made here).
    original = jax.tree.map(jnp.copy, state)
    after, _ = c.step_fn(original, batch)
    resumed, _ = c.step_fn(restored.state, batch)
    np.testing.assert_array_equal(bias(resumed), bias(after))
    assert not np.array_equal(bias(after), bias(state))


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(top_k=9), "top-k 9 must lie in [1, 8 experts]"),
        (dict(n_group=3), "n_group 3 must divide the 8 experts"),
        (dict(n_group=4, topk_group=5), "topk_group 5 must lie in [1, 4 groups"),
        (dict(n_group=4, topk_group=1, top_k=3), "top-k 3 is more experts than the 1 chosen"),
        (dict(scoring="relu"), "router scoring 'relu'"),
        (dict(bias_update_rate=0.001), "bias_update_rate 0.001 needs router_bias"),
        (dict(n_shared_experts=1, shared_expert_intermediate_size=64), "give the shared"),
        (dict(shared_expert_gate=True), "shared_expert_gate gates a shared expert"),
    ],
)
def test_bad_router_settings_end_in_one_line(over, message):
    with pytest.raises(ConfigError) as e:
        _config(**over)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_deepseek_v3_routing_half_of_its_config_and_weights():
    # The MoE half of DeepSeek-V3's import: config fields and weight names.
    from models.hf_config import deepseek_moe
    from models.hf_pieces import deepseek_router_pieces, export_pieces

    hf = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
    hf |= dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1)
    c = _config(**deepseek_moe(hf | {"first_k_dense_replace": 0}, "ds"))
    assert (c.scoring, c.n_group, c.topk_group, c.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert (c.router_bias, c.shared_width, c.moe_renormalize) == (True, 24, True)
    names = {p.name(0): p.ours for p in deepseek_router_pieces(c)}
    assert names == {
        "model.layers.0.mlp.gate.e_score_correction_bias": "expert_bias_LE",
        "model.layers.0.mlp.shared_experts.gate_proj.weight": "shared_w_gate_LDF",
        "model.layers.0.mlp.shared_experts.up_proj.weight": "shared_w_up_LDF",
        "model.layers.0.mlp.shared_experts.down_proj.weight": "shared_w_down_LFD",
    }
    dense = deepseek_moe(hf | {"first_k_dense_replace": 3, "intermediate_size": 64}, "ds")
    assert (dense["dense_layers"], dense["dense_d_mlp"]) == (3, 64)
    # Without MLA there is no DeepSeek-V3 form: refused in one line, not written half.
    with pytest.raises(ConfigError, match="no Hugging Face form here yet"):
        export_pieces(c, 256)
