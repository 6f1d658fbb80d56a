"""The transformer (models/transformer.py) as a jaxdist.hf.family.ModelFamily: what the
library's Hugging Face import, export and generation need of it (models/hf.py, decode.py,
presets.py). The command line hands FAMILY to the library, which never imports models/."""

import dataclasses
import functools

from jaxdist.hf.family import HFTensor, ModelFamily
from models import decode, hf
from models.presets import from_record, model_spec
from models.transformer import TransformerConfig


def _with_seq_len(model: hf.HFModel, seq_len: int) -> hf.HFModel:
    return model._replace(config=dataclasses.replace(model.config, seq_len=seq_len))


def _learned_positions(c: TransformerConfig) -> int | None:
    return c.seq_len if c.style == "gpt2" else None  # Llama's RoPE positions are computed


def _export_tensors(c: TransformerConfig, vocab: int) -> list[HFTensor]:
    pieces, c = hf.export_pieces(c, vocab)
    return [
        HFTensor(p.name(layer), p.hf_shape, p.ours, layer, functools.partial(hf.hf_tensor, p))
        for p in pieces
        for layer in (range(c.num_layers) if hf.layered(p.ours) else [None])
    ]


def _computing(c: TransformerConfig, compute_dtype: str) -> TransformerConfig:
    # XLA's attention: the decoder's own (export computes nothing; any kernel gives the same).
    # MoE layers dense: every token reaches its experts, as in transformers (models/decode.py).
    moe_impl = "dense" if c.num_experts else c.moe_impl
    return dataclasses.replace(c, compute_dtype=compute_dtype, attention="xla", moe_impl=moe_impl)


FAMILY = ModelFamily(
    open=hf.open_model,
    check_weights=hf.check_weights,
    load=hf.load,
    with_seq_len=_with_seq_len,
    learned_positions=_learned_positions,
    export_tensors=_export_tensors,
    export_config=hf.export_config,
    from_record=from_record,
    model_spec=model_spec,
    computing=_computing,
    # What the tensor axis splits (meshes/presets.py): kv heads (so heads), MLP and vocabulary.
    tensor_dims=lambda c: (c.num_kv_heads, c.d_mlp, c.vocab_size),
    decoder=decode.decoder,
)
