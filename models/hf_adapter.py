"""The transformer (models/transformer.py) to and from Hugging Face's form, as the library's
jaxdist.hf.adapter.HFAdapter: configs both ways (models/hf_config.py), tensors both ways
(models/hf.py reads them a shard at a time, models/hf_pieces.py maps their names and layouts),
and a run's recorded model. The command line hands ADAPTER to the library, which never imports
models/; the rest the library needs of a model is its ModelSpec (models/presets.py)."""

import functools
import pathlib

from jaxdist.hf.adapter import HFTensor
from jaxdist.model import ModelSpec
from models import hf
from models.presets import from_record, model_spec
from models.transformer_config import TransformerConfig, stack_size


class TransformerHF:
    """The transformer's Hugging Face adapter (stateless: one is ADAPTER)."""

    def open(self, path: pathlib.Path) -> hf.HFModel:
        return hf.open_model(path)

    def hf_config(
        self,
        config: TransformerConfig,
        vocab: int,
        base: dict | None,
        dtype: str,
        eos_id: int | None,
    ) -> dict:
        return hf.export_config(config, vocab, base, dtype, eos_id)

    def from_hf(self, model: hf.HFModel, targets: dict) -> dict:
        return hf.load(model, targets)

    def to_hf(self, config: TransformerConfig, vocab: int) -> list[HFTensor]:
        pieces, c = hf.export_pieces(config, vocab)
        return [
            HFTensor(p.name(layer), p.hf_shape, p.ours, layer, functools.partial(hf.hf_tensor, p))
            for p in pieces
            for layer in (range(stack_size(c, p.ours)) if hf.layered(p.ours) else [None])
        ]

    def from_record(self, fields: dict) -> ModelSpec:
        return model_spec(from_record(fields))


ADAPTER = TransformerHF()
