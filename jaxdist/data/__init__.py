"""Data: raw text as bytes, tokenized directories (flat token shards), mixtures of them, and
the deterministic batches the loop reads (jaxdist.data.batches).

Names load on first use: `jaxdist tokenize`'s worker processes import the tokenizer and the
format alone, not grain and jax (a second and 170 MB per worker)."""

from jaxdist import lazy_api

_API = {
    "TokenBatches": "jaxdist.data.batches",
    "default_corpus": "jaxdist.data.corpus",
    "load_corpus": "jaxdist.data.corpus",
}
__all__ = sorted([*_API, "padded_vocab"])


def padded_vocab(vocab_size: int, multiple: int = 128) -> int:
    """The model's vocabulary for data of `vocab_size` tokens: rounded up for the matmul tiles;
    the padded ids are never predicted (the loss masks them)."""
    return -(-vocab_size // multiple) * multiple


__getattr__ = lazy_api(__name__, _API)
