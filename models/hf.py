"""Hugging Face models in and out: a local model directory opened as a TransformerConfig
(models/hf_config.py reads each architecture's config.json), its weights checked and read into
our stacked, fused parameters a device's shard at a time (models/hf_pieces.py maps the tensors).

Legend: as models/transformer.py.
"""

import dataclasses
import math
import pathlib
from typing import NamedTuple

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.model import ModelSpec
from models.hf_config import (  # noqa: F401 (the adapter's and the tests' names for them)
    SUPPORTED,
    architecture,
    checkpoint_mtp,
    config_from_hf,
    export_config,
    read_config,
)
from models.hf_pieces import Piece, export_pieces, hf_tensor, layered, pieces  # noqa: F401
from models.presets import model_spec
from models.transformer_config import TransformerConfig, _param_shapes, stack_size

# Non-weights that some saved checkpoints carry: attention-mask and RoPE buffers.
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


class HFModel(NamedTuple):
    """A local Hugging Face model directory, read: its config.json as ours and what export
    and generation need to give it back (jaxdist.hf.adapter.OpenedModel)."""

    path: pathlib.Path
    hf_config: dict
    architecture: str
    config: TransformerConfig
    vocab_size: int  # the model's own, before padding
    prefix: str  # GPT-2 checkpoints come with "transformer." or without

    @property
    def spec(self) -> ModelSpec:
        return model_spec(self.config)

    def record(self) -> dict:
        return {
            "path": str(self.path.absolute()),
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "config": self.hf_config,
        }

    def check_weights(self) -> None:
        from jaxdist.hf.safetensors_io import SafetensorsDir

        check_weights(self, SafetensorsDir(self.path).tensors)

    def with_seq_len(self, seq_len: int) -> "HFModel":
        # GPT-2 learned a position embedding for each of its n_positions, and no more; Llama's
        # RoPE positions are computed, for any length its scaling allows (TransformerConfig).
        learned = self.hf_config["n_positions"] if self.config.style == "gpt2" else None
        if learned is not None and seq_len > learned:
            raise ConfigError(
                f"hf:{self.path} has learned positions for {learned} tokens only, fewer than "
                f"{seq_len}"
            )
        return self._replace(config=dataclasses.replace(self.config, seq_len=seq_len))


def open_model(path: pathlib.Path) -> HFModel:
    """The model directory's config, read and checked (no weights yet)."""
    path = pathlib.Path(path)
    hf = read_config(path)
    config, vocab = config_from_hf(hf, f"hf:{path.name}", str(path))
    config = checkpoint_mtp(config, path, f"hf:{path}")
    prefix = ""
    if config.style == "gpt2":
        from jaxdist.hf.safetensors_io import INDEX, SINGLE, SafetensorsDir

        # GPT-2's weights come with or without a "transformer." prefix; a directory of
        # config.json alone (to plan or compile its architecture) has none to read.
        if (path / INDEX).is_file() or (path / SINGLE).is_file():
            names = SafetensorsDir(path).tensors
            prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
    return HFModel(path, hf, architecture(hf, str(path)), config, vocab, prefix)


def check_weights(model: HFModel, tensors: dict) -> list[Piece]:
    """Every tensor the config implies is there with its shape, and nothing unknown is; the
    pieces to load. `tensors`: name -> TensorInfo (jaxdist.hf.safetensors_io)."""
    c = model.config
    positions = model.hf_config.get("n_positions", c.seq_len)
    plan = pieces(c, model.vocab_size, positions, model.prefix)
    expected = {}
    for piece in plan:
        for layer in range(stack_size(c, piece.ours)) if layered(piece.ours) else [None]:
            expected[piece.name(layer)] = piece.hf_shape
    for name, shape in expected.items():
        if name not in tensors:
            raise ConfigError(
                f"{model.path}: weight {name} is missing from its safetensors files (config.json "
                f"describes a {model.architecture} with {c.num_layers} layers"
                f"{', untied head' if not c.tie_embeddings else ''}); is the directory complete?"
            )
        if tuple(tensors[name].shape) != shape:
            raise ConfigError(
                f"{model.path}: weight {name} has shape {list(tensors[name].shape)}, config.json "
                f"implies {list(shape)}; the weights and config.json disagree"
            )
    ignorable = _BUFFERS + (("lm_head.weight",) if c.tie_embeddings else ())
    # DeepSeek-V3's multi-token prediction modules: layers past the model's, which transformers
    # drops on load too (its _keys_to_ignore_on_load_unexpected).
    mtp = model.hf_config.get("num_nextn_predict_layers") or 0
    beyond = tuple(f"model.layers.{c.num_layers + i}." for i in range(mtp))
    extra = [
        n
        for n in tensors
        if n not in expected and not n.endswith(ignorable) and not n.startswith(beyond)
    ]
    if extra:
        raise ConfigError(
            f"{model.path}: weights {', '.join(sorted(extra)[:5])} are not part of a "
            f"{model.architecture} as config.json describes it; refusing to drop them"
        )
    return plan


def read_block(reader, name: str, piece: Piece, index: tuple[slice, ...]) -> np.ndarray:
    """Our per-layer block `index` (concrete slices over our dims) of one HF tensor: reads
    only the rows/columns covering it (whole inner factors), zero where ours is padded."""
    sizes = [f for dim in piece.factors for f in dim]
    want = [None] * len(sizes)
    for ours_dim, factor in enumerate(piece.perm):
        want[factor] = index[ours_dim]
    clipped = [slice(min(s.start, n), min(s.stop, n)) for s, n in zip(want, sizes, strict=True)]
    out_shape = tuple(s.stop - s.start for s in want)
    if any(s.stop <= s.start for s in clipped):
        return np.zeros(tuple(out_shape[f] for f in piece.perm), np.float32)
    read, shape, inner, first = [], [], [], 0
    for dim in piece.factors:
        rest = math.prod(dim[1:])
        outer = clipped[first]
        read.append(slice(outer.start * rest, outer.stop * rest))
        shape += [outer.stop - outer.start, *dim[1:]]
        inner += [slice(None), *clipped[first + 1 : first + len(dim)]]
        first += len(dim)
    block = reader.read(name, tuple(read)).reshape(shape)[tuple(inner)]
    pad = [(0, w.stop - w.start - (c.stop - c.start)) for w, c in zip(want, clipped, strict=True)]
    if any(p[1] for p in pad):
        block = np.pad(block, pad)
    return np.transpose(block, piece.perm)


def filler(reader, model: HFModel, plan: list[Piece]):
    """fill(name, index) for jaxdist.hf.safetensors_io.load_sharded: our parameter's
    block, assembled from the HF slices it covers, layer by layer."""
    by_name: dict[str, list[Piece]] = {}
    for piece in plan:
        by_name.setdefault(piece.ours, []).append(piece)

    def one_layer(ours: str, layer: int | None, index: tuple[slice, ...]) -> np.ndarray:
        parts = []
        for piece in by_name[ours]:
            if piece.rows is None:
                return read_block(reader, piece.name(layer), piece, index)
            q = index[piece.rows_axis]
            lo, hi = max(q.start, piece.rows[0]), min(q.stop, piece.rows[1])
            if lo < hi:
                sub = list(index)
                sub[piece.rows_axis] = slice(lo - piece.rows[0], hi - piece.rows[0])
                parts.append(read_block(reader, piece.name(layer), piece, tuple(sub)))
        return np.concatenate(parts, axis=by_name[ours][0].rows_axis)

    def fill(ours: str, index: tuple[slice, ...]) -> np.ndarray:
        if not layered(ours):
            return one_layer(ours, None, index)
        layers = range(index[0].start, index[0].stop)
        return np.stack([one_layer(ours, layer, index[1:]) for layer in layers])

    return fill


def load(model: HFModel, targets: dict) -> dict:
    """Our parameters (name -> global jax array laid out as `targets` say: ShapeDtypeStructs
    with shardings), read from the model directory's safetensors a shard at a time."""
    from jaxdist.hf.safetensors_io import SafetensorsDir, load_sharded

    reader = SafetensorsDir(model.path)
    plan = check_weights(model, reader.tensors)
    expect = _param_shapes(model.config)
    for name, t in targets.items():
        if name not in expect or tuple(t.shape) != expect[name]:
            raise ConfigError(f"parameter {name} {t.shape} is not one of {model.config.name}'s")
    return load_sharded(targets, filler(reader, model, plan))
