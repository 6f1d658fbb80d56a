"""A model written outside jaxdist (experiments/own_model.py) trains through the public API to
the same losses on every layout, with its weights sharded as the rule table says."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import jaxdist
from jaxdist.kernels import documents
from jaxdist.layout import Layout
from jaxdist.rules import activation_rules
from meshes.presets import STANDARD_RULES
from tests.helpers import load_experiment, mesh_for

STEPS = 4
# data=8 is the reference; the quick loop keeps the default layout beside it.
LAYOUTS = ["data=8", pytest.param("fsdp=8", marks=pytest.mark.slow), "data=2,fsdp=2,tensor=2"]
own_model = load_experiment("own_model")


@functools.cache
def _train(layout: str):
    """STEPS steps of the script's model on this layout, same seed and batches everywhere."""
    mesh = mesh_for(layout)
    config = jaxdist.RunConfig(
        data=jaxdist.DataConfig(batch_size=16),
        optim=jaxdist.OptimConfig(warmup_steps=2),
        loop=jaxdist.LoopConfig(steps=STEPS, seed=0),
    )
    jitted, batches = jaxdist.prepare(own_model.model_spec(), mesh, STANDARD_RULES, config)
    state = jitted.init_fn()
    losses = []
    for s in range(STEPS):
        batch = jax.device_put(batches.batch(s), jitted.batch_sharding)
        state, metrics = jitted.step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return mesh, state, losses


def _params(state) -> dict[str, nnx.Variable]:
    flat = jax.tree_util.tree_leaves_with_path(
        state.params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return {"/".join(str(getattr(k, "key", k)) for k in path): var for path, var in flat}


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_losses_equal_on_every_layout(layout):
    _, _, reference = _train("data=8")
    _, _, losses = _train(layout)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert losses[-1] < losses[0]  # it learns


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_weights_are_sharded_by_the_rules(layout):
    mesh, state, _ = _train(layout)
    params = _params(state)
    assert {"embed_VD", "head_DV", "blocks/0/w_up_DF", "blocks/1/w_down_FD"} <= set(params)
    split = 0
    for name, var in params.items():
        logical = var.logical_axes
        spec = STANDARD_RULES.spec(logical, "param")
        arr = var[...]
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), name
        axes = [a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())]
        ways = math.prod(mesh.shape[a] for a in axes)
        # Each device holds a 1/ways slice, not a full copy.
        assert arr.addressable_shards[0].data.size * ways == arr.size, name
        if "embed" in logical:
            assert "fsdp" in axes, name
            split += ways > 1
    # Every weight with an embed dim (embedding, head, MLP, norm scales) is really split.
    assert split == sum("embed" in v.logical_axes for v in params.values()) >= 8
    if "tensor" in layout:
        head = params["head_DV"][...]
        assert head.addressable_shards[0].data.shape == (head.shape[0] // 2, head.shape[1] // 2)


def test_packed_documents_mix_only_within_themselves():
    # The step passes documents when document masking is on: b's logits ignore document a
    # before it, and are b's own at the start of a row (positions restart), as without docs.
    eos = 255
    model = own_model.MixerLM(own_model.MixerConfig(seq_len=16), nnx.Rngs(0))
    a, b, rest = [eos, 1, 2, 3, 4], [eos, 5, 6, 7], [eos, 8, 9, 10, 11, 12, 13]
    rows_BT = jnp.array([a + b + rest, [eos, 9, 9, 9, 9] + b + rest, b + rest + a])
    at_b = slice(len(a), len(a) + len(b))
    graphdef, params = nnx.split(model)

    @jax.jit  # one program with documents (their ids and positions are arguments), one without
    def logits(params, docs):
        with activation_rules(Layout.on(mesh_for("single"), STANDARD_RULES), mesh_for("single")):
            return nnx.merge(graphdef, params)(rows_BT, docs)[0]

    logits_BTV = np.asarray(logits(params, documents.from_tokens(rows_BT, eos)))
    plain_BTV = np.asarray(logits(params, None))
    # 254 occurs nowhere: each row is one document, as in the plain call.
    one_doc_BTV = np.asarray(logits(params, documents.from_tokens(rows_BT, 254)))
    assert np.abs(logits_BTV[0, : len(a)] - logits_BTV[1, : len(a)]).max() > 1e-4
    np.testing.assert_array_equal(logits_BTV[1, at_b], logits_BTV[0, at_b])
    np.testing.assert_allclose(logits_BTV[2, : len(b)], logits_BTV[0, at_b], rtol=0, atol=1e-5)
    np.testing.assert_allclose(plain_BTV[2, : len(b)], logits_BTV[0, at_b], rtol=0, atol=1e-5)
    np.testing.assert_allclose(one_doc_BTV, plain_BTV, rtol=0, atol=1e-6)
