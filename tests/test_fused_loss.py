"""The fused, chunked cross-entropy equals the plain one on whole logits: loss and gradients,
sharded over every strategy at once, with a padded vocabulary and packed documents."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.kernels.fused_loss import _chunks
from jaxdist.kernels.loss import Vocab
from jaxdist.layout import Layout
from jaxdist.rules import activation_rules
from jaxdist.step import forward_loss
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from models.transformer import Transformer
from tests.helpers import mesh_for


@functools.cache
def _split(mc):
    return nnx.split(Transformer(mc, nnx.Rngs(0)))


def _loss_and_grads(mc, layout: str, tokens_BT1, vocab: Vocab, chunk_tokens: int):
    mesh = mesh_for(layout)
    graphdef, params = _split(mc)

    def loss(params, tokens_BT1):
        with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
            model = nnx.merge(graphdef, params)
            return forward_loss(model, tokens_BT1, vocab, True, chunk_tokens)[0]

    return jax.jit(jax.value_and_grad(loss))(params, tokens_BT1)


# Tokenized data of 250 ids, the model's vocabulary padded to 256; EOS 0 packs documents.
VOCAB = Vocab(250, 0)


@functools.cache
def _whole(tie: bool):
    """The plain loss on whole logits, on one device, and the batch it is of."""
    mc = get_model_config("tiny", tie_embeddings=tie)
    tokens = jax.random.randint(jax.random.key(1), (16, mc.seq_len + 1), 0, 250, jnp.int32)
    return mc, tokens, _loss_and_grads(mc, "single", tokens, VOCAB, 0)


@pytest.mark.slow
@pytest.mark.parametrize(("tie", "chunk_tokens"), [(False, 64), (True, 64), (False, 1 << 20)])
def test_chunked_loss_and_grads_equal_whole_logits(tie, chunk_tokens):
    # 8 devices: data=2 x fsdp=2 shard the 16 rows 4 ways, tensor=2 splits the vocabulary.
    # 64 tokens per device per chunk: 4 rows x 16 positions, so the sequence is cut in 8 (the
    # head's gradient accumulated per batch shard); 2^20: one chunk (one matmul for it). On one
    # device the same code runs with one batch shard; compiling is this test's cost, so only
    # the sharded layout is run.
    mc, tokens, whole = _whole(tie)
    layout = "data=2,fsdp=2,tensor=2"
    with activation_rules(Layout.on(mesh_for(layout), STANDARD_RULES), mesh_for(layout)):
        assert _chunks(16, mc.seq_len, chunk_tokens) == (4, 8 if chunk_tokens == 64 else 1)
    loss, grads = _loss_and_grads(mc, layout, tokens, VOCAB, chunk_tokens)
    np.testing.assert_allclose(loss, whole[0], rtol=1e-5)
    want = dict(nnx.to_flat_state(whole[1]))
    for name, g in nnx.to_flat_state(grads):
        np.testing.assert_allclose(g[...], want[name][...], rtol=2e-4, atol=2e-6, err_msg=str(name))
