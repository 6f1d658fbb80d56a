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
from jaxdist.rules import constrain


class Vocab(NamedTuple):
    """What the step must know of the data's tokens: the vocabulary it uses (the model's may be
    padded past it, and a padded id is never predicted) and its EOS id (None: rows are not
    packed documents, as for raw bytes)."""

    size: int | None = None
    eos_id: int | None = None


def cross_entropy(
    logits_BTV: jax.Array,
    targets_BT: jax.Array,
    vocab_size: int | None = None,
    mask_BT: jax.Array | None = None,
) -> jax.Array:
    """Mean next-token loss, in fp32 whatever the compute dtype; ids >= vocab_size (padding of
    the model's vocabulary) get no probability. `mask_BT`: the mean over the positions it keeps
    only (0 where it keeps none; multi-token prediction's depths, whose last targets do not
    exist)."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    V = logits_BTV.shape[-1]
    if vocab_size is not None and vocab_size < V:
        logits_BTV = jnp.where(jnp.arange(V) < vocab_size, logits_BTV, -jnp.inf)
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
    if mask_BT is None:
        return losses_BT.mean()
    return jnp.sum(jnp.where(mask_BT, losses_BT, 0.0)) / jnp.maximum(jnp.sum(mask_BT), 1)


def _head_loss(h_BTD, head_DV, targets_BT, mask_BT, vocab_size, chunk_tokens: int) -> jax.Array:
    """Mean cross-entropy of logits = h @ head (over `mask_BT`'s positions where given): fused
    where `chunk_tokens` > 0, else from the whole logits."""
    if not chunk_tokens:
        logits_BTV = constrain(jnp.einsum("btd,dv->btv", h_BTD, head_DV), ("batch", "seq", "vocab"))
        return cross_entropy(logits_BTV, targets_BT, vocab_size, mask_BT)
    if mask_BT is None:
        return fused_cross_entropy(h_BTD, head_DV, targets_BT, vocab_size, chunk_tokens)
    # The fused loss means over every position. A left-out one is given h = 0 (no gradient
    # reaches its h through the `where`, and none reaches the head from h = 0): its logits are
    # all 0, its loss exactly log(the vocabulary), taken back out of the sum.
    V = min(head_DV.shape[1], vocab_size or head_DV.shape[1])
    h_BTD = jnp.where(mask_BT[..., None], h_BTD, jnp.zeros((), h_BTD.dtype))
    targets_BT = jnp.where(mask_BT, targets_BT, 0)
    mean = fused_cross_entropy(h_BTD, head_DV, targets_BT, vocab_size, chunk_tokens)
    count, kept = mask_BT.size, jnp.sum(mask_BT)
    return (mean * count - (count - kept) * jnp.log(jnp.float32(V))) / jnp.maximum(kept, 1)


def _loss_ahead(model, inputs_BT, targets_BT, docs, vocab_size, chunk_tokens: int):
    """model_loss with the model's multi-token prediction modules (DeepSeek-V3's MTP): the
    next-token loss as ever, and in the auxiliary loss lambda x the mean of the depths' losses
    (each over the positions whose target exists: models/mtp.py), which the `mtp_loss` metric
    reports unweighted beside the next-token `loss`."""
    h_BTD, head_DV, aux, depths = model.ahead(inputs_BT, targets_BT, docs)
    loss = _head_loss(h_BTD, head_DV, targets_BT, None, vocab_size, chunk_tokens)
    losses = [_head_loss(h, head_DV, t, m, vocab_size, chunk_tokens) for h, t, m in depths]
    mtp = sum(losses) / len(losses)
    return loss, aux | {
        "loss": aux["loss"] + model.mtp_loss_weight * mtp,
        "metrics": aux["metrics"] | {"mtp_loss": mtp},
    }


def model_loss(
    model,
    inputs_BT: jax.Array,
    targets_BT: jax.Array,
    docs,
    vocab_size,
    chunk_tokens: int = 0,
    train: bool = False,
):
    """Mean cross-entropy of the model's next-token predictions, and its auxiliary output;
    `docs` (jaxdist.kernels.documents.Documents, or None: one sequence per row) is passed on.

    A model with `features(tokens_BT, docs=None) -> (h_BTD, head_DV, aux)` (the last hidden
    state and the output head, logits = h @ head) gets the fused loss (`chunk_tokens` > 0):
    its logits are never whole in memory; any other model is called for its logits.

    In training (`train`), a model with multi-token prediction modules (`mtp_depth` > 0) runs
    them too (`_loss_ahead`: its `ahead(tokens_BT, targets_BT, docs)`); evaluation never does."""
    if train and getattr(model, "mtp_depth", 0):
        return _loss_ahead(model, inputs_BT, targets_BT, docs, vocab_size, chunk_tokens)
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
