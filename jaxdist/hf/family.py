"""What the Hugging Face machinery (jaxdist/hf/) needs of a family of models, and nothing more.

The library never imports models/: the command line hands it a `ModelFamily`
(models/hf_family.py: FAMILY, the transformer's). The family reads a local Hugging Face
directory as its own config (`open`), checks its weights and reads them into sharded arrays,
gives its parameters back as Hugging Face tensors with a config.json, and says what training,
the mesh choice and the decoder need of a config. Configs and opened models are the family's
own objects: the library only hands them back to it, and reads an opened model's few common
fields (`OpenedModel`).
"""

import dataclasses
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    from jaxdist.inference.generate import Decoder
    from jaxdist.model import ModelSpec


class OpenedModel(Protocol):
    """A local Hugging Face model directory, read and checked: config.json, no weights yet."""

    path: pathlib.Path
    hf_config: dict  # its config.json
    config: Any  # as the family's config, vocabulary padded
    vocab_size: int  # its own, before padding

    def record(self) -> dict:
        """What a run started from it records (JSON)."""
        ...


class HFTensor(NamedTuple):
    """One Hugging Face tensor an export writes, from one of our parameters (one layer of it)."""

    name: str
    shape: tuple[int, ...]
    ours: str  # the parameter it comes from
    layer: int | None  # its layer, for a parameter stacked over layers
    # Our gathered tensor (that layer's), or None where we have no such parameter -> HF's.
    convert: Callable[[np.ndarray | None], np.ndarray]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """The model-specific half of import, export, generation and `train --init-from`."""

    open: Callable[[str], OpenedModel]
    """hf:PATH -> the directory's config.json as ours, checked (ConfigError: why not)"""
    check_weights: Callable[[OpenedModel, dict], Any]
    """(model, name -> safetensors TensorInfo): every weight there with its shape, none unknown"""
    load: Callable[[OpenedModel, dict], dict]
    """(model, name -> ShapeDtypeStruct with sharding) -> name -> global array, read by shards"""
    with_seq_len: Callable[[OpenedModel, int], OpenedModel]
    """the model with a shorter context"""
    learned_positions: Callable[[Any], int | None]
    """config -> the positions it learned (no longer context possible); None: any length"""
    export_tensors: Callable[[Any, int], list[HFTensor]]
    """(config, HF vocabulary) -> every tensor of its Hugging Face form, in order"""
    export_config: Callable[[Any, int, dict | None, str, int | None], dict]
    """(config, HF vocabulary, the source's config.json or None, dtype, EOS) -> config.json"""
    from_record: Callable[[dict], Any]
    """a run's recorded model (its config.json's "model") -> config"""
    model_spec: Callable[[Any], "ModelSpec"]
    """config -> what the loop needs (init for shapes, context, vocabulary)"""
    computing: Callable[[Any, str], Any]
    """(config, compute dtype) -> the config as generation and export compute it"""
    tensor_dims: Callable[[Any], tuple[int, ...]]
    """config -> the sizes the tensor axis splits (each must divide by its ways)"""
    decoder: Callable[[Any], "Decoder"]
    """config -> its KV-cache decoder (ConfigError where it has none)"""
