"""Training from a local Hugging Face model: its pretrained weights (`train --init-from hf:PATH`:
a fresh optimizer, step 0) or its architecture alone (`--model hf:PATH`). The data checked
against the model before anything starts, and the run's first state. The model comes opened
(jaxdist.hf.source.check); what is model-specific is its adapter's (jaxdist/hf/adapter.py)."""

import pathlib

from jaxdist.errors import ConfigError
from jaxdist.hf.adapter import HFAdapter, OpenedModel
from jaxdist.hf.source import TOKENIZER


def check_data(model: OpenedModel, data: str | None, data_vocab: int, pretrained: bool) -> None:
    """An HF architecture keeps its vocabulary: refuses data (`data`, its vocabulary
    `data_vocab`) that does not fit in it, and data for pretrained weights not tokenized with
    their own tokenizer."""
    name = f"hf:{model.path}"
    fix = f"jaxdist tokenize --tokenizer {model.path / TOKENIZER} --out DIR --input FILE"
    if data_vocab > model.vocab_size:
        raise ConfigError(
            f"the data's vocabulary has {data_vocab} tokens, {name} has {model.vocab_size}; "
            f"tokenize the data with the model's tokenizer: {fix}"
        )
    theirs = model.path / TOKENIZER
    if pretrained and theirs.is_file():
        ours = pathlib.Path(data) / TOKENIZER if data else None
        if ours is None or not ours.is_file() or ours.read_bytes() != theirs.read_bytes():
            raise ConfigError(
                f"the data ({data or 'the embedded corpus, as bytes'}) is not tokenized with the "
                f"model's tokenizer, so its ids mean other text to {name}'s pretrained weights; "
                f"prepare it with {fix}"
            )


def initial_state(adapter: HFAdapter, model: OpenedModel):
    """The run's first state, for jaxdist.train's `init_state`: the HF weights, read into the
    step's parameter layout, and a fresh optimizer state (step 0; every replica group's)."""

    def make(jitted):
        import jax

        abstract = jitted.abstract_params  # one model's weights, also with replica groups
        flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
        params = adapter.from_hf(model, {path[0].key: leaf for path, leaf in flat})
        tree = jax.tree_util.tree_map_with_path(lambda p, _: params[p[0].key], abstract)
        return jitted.start_fn(tree)

    return make
