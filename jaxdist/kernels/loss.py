"""The next-token loss, stage 2's last step: plain (`cross_entropy`, over the model's logits) or
fused (jaxdist.kernels.fused_loss, over its last hidden state and head), for the whole model
(`forward_loss`) or a pipeline's last stage (`stage_loss`)."""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxdist.kernels.fused_loss import fused_cross_entropy
from jaxdist.model import Stages


class Vocab(NamedTuple):
    """What the step must know of the data's tokens: the vocabulary it uses (the model's may be
    padded past it, and a padded id is never predicted) and its EOS id (None: rows are not
    packed documents, as for raw bytes)."""

    size: int | None = None
    eos_id: int | None = None


def cross_entropy(
    logits_BTV: jax.Array, targets_BT: jax.Array, vocab_size: int | None = None
) -> jax.Array:
    """Mean next-token loss, in fp32 whatever the compute dtype; ids >= vocab_size (padding of
    the model's vocabulary) get no probability."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    V = logits_BTV.shape[-1]
    if vocab_size is not None and vocab_size < V:
        logits_BTV = jnp.where(jnp.arange(V) < vocab_size, logits_BTV, -jnp.inf)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()


def model_loss(
    model, inputs_BT: jax.Array, targets_BT: jax.Array, docs, vocab_size, chunk_tokens: int = 0
):
    """Mean cross-entropy of the model's next-token predictions, and its auxiliary output;
    `docs` (jaxdist.kernels.documents.Documents, or None: one sequence per row) is passed on.

    A model with `features(tokens_BT, docs=None) -> (h_BTD, head_DV, aux)` (the last hidden
    state and the output head, logits = h @ head) gets the fused loss (`chunk_tokens` > 0):
    its logits are never whole in memory; any other model is called for its logits."""
    docs = () if docs is None else (docs,)
    # (without docs, a model that knows nothing of documents is called as it always was)
    if chunk_tokens and hasattr(model, "features"):
        h_BTD, head_DV, aux = model.features(inputs_BT, *docs)
        return fused_cross_entropy(h_BTD, head_DV, targets_BT, vocab_size, chunk_tokens), aux
    logits_BTV, aux = model(inputs_BT, *docs)
    return cross_entropy(logits_BTV, targets_BT, vocab_size), aux


def stage_loss(stages: Stages, vocab: Vocab, chunk_tokens: int) -> Callable:
    """The pipeline's last stage's loss from its output, `(weights, y_bTD, targets_bT) -> mean`:
    fused, as `model_loss`'s, where the model offers its features."""
    if chunk_tokens and stages.features is not None:

        def fused(weights, y_bTD, targets_bT):
            h_bTD, head_DV = stages.features(weights, y_bTD)
            return fused_cross_entropy(h_bTD, head_DV, targets_bT, vocab.size, chunk_tokens)

        return fused
    return lambda weights, y_bTD, targets_bT: cross_entropy(
        stages.head(weights, y_bTD), targets_bT, vocab.size
    )
