"""Packed documents: which document each token of a row belongs to, and its position in it.

A row of tokenized data is a window of documents with EOS between them, and EOS opens each
document (jaxdist.data.manifest). From the tokens alone, on device, the step derives per-token
document ids and positions that restart at every document; the model turns them into a
block-diagonal causal mask (attention never crosses a document boundary) and per-document
positions (learned or RoPE). Nothing extra travels from the host: the batch stays [B, T+1].
"""

import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxdist.errors import ConfigError
from jaxdist.layout import Layout


class Documents(NamedTuple):
    # int32: equal within one document of a row, rising along it (None: one per row)
    segment_ids_BT: jax.Array | None
    positions_BT: jax.Array  # int32: 0 at each document's first token (its EOS)
    # int32 [T]: each token's place in the row, where the sequence was reordered for context
    # parallelism (jaxdist.parallel.context); None: tokens are in row order
    index_T: jax.Array | None = None


def from_tokens(tokens_BT: jax.Array, eos_id: int) -> Documents:
    """The documents of each row; a row's leading partial document is segment 0 and its
    positions start at 0 where the window starts (its beginning was cut off)."""
    T = tokens_BT.shape[1]
    starts_BT = tokens_BT == eos_id
    segment_ids_BT = jnp.cumsum(starts_BT, axis=1, dtype=jnp.int32)
    t_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens_BT.shape)
    last_start_BT = jax.lax.cummax(jnp.where(starts_BT, t_BT, 0), axis=1)
    return Documents(segment_ids_BT, t_BT - last_start_BT)


def attention_mask(docs: Documents) -> jax.Array:
    """[B, 1, T, T] bool: query t may see key u of the same document (causality is applied
    by the attention call itself)."""
    seg_BT = docs.segment_ids_BT
    return seg_BT[:, None, :, None] == seg_BT[:, None, None, :]


def check_model(abstract_model, layout: Layout, eos_id: int | None) -> None:
    """Packed documents (data with an `eos_id`), and a sequence split over devices, need a
    model whose __call__ takes `docs` (the latter: each token's place in the row,
    jaxdist.parallel.context)."""
    params = inspect.signature(type(abstract_model).__call__).parameters
    takes = "docs" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    name = type(abstract_model).__name__
    if not takes and layout.seq_ways > 1:
        raise ConfigError(
            f"{name} takes no `docs`, which carry each token's place in the row when the "
            f"sequence is split over {'x'.join(layout.seq_axes)}; add "
            "`docs: jaxdist.kernels.documents.Documents | None = None` to its __call__, or use "
            "a mesh without a context axis"
        )
    if layout.step.document_mask and eos_id is not None and not takes:
        raise ConfigError(
            f"{name} is called without document masks (its __call__ takes no `docs`), and "
            "this data packs documents; add "
            "`docs: jaxdist.kernels.documents.Documents | None = None` to it, or pass "
            "--no-document-mask (StepConfig(document_mask=False))"
        )
