"""What the Hugging Face machinery (jaxdist/hf/) needs of a family of models, and nothing more.

The library never imports models/: the command line hands it an `HFAdapter` (models/hf_adapter.py:
ADAPTER, the transformer's), as torchtitan keeps a state-dict adapter beside each model. The
adapter converts both ways, configs and tensors: a Hugging Face directory's config.json read as
ours (`open`) and ours written as one (`hf_config`), its tensors read into our sharded parameters
(`from_hf`) and ours given back as its tensors (`to_hf`); and a run's recorded model read back
(`from_record`). Everything else the library computes with is the model's `ModelSpec`
(jaxdist/model.py): its init for shapes, context, decoder and the sizes the tensor axis splits.
Configs are the family's own objects: the library only hands them back to the adapter.
"""

import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    from jaxdist.model import ModelSpec


class OpenedModel(Protocol):
    """A local Hugging Face model directory, its config.json read and checked; no weights read."""

    path: pathlib.Path
    hf_config: dict  # its config.json
    vocab_size: int  # its own, before padding

    @property
    def spec(self) -> "ModelSpec":
        """The model as ours, its vocabulary padded."""
        ...

    def record(self) -> dict:
        """What a run started from it records (JSON)."""
        ...

    def check_weights(self) -> None:
        """Every weight config.json implies is in its safetensors files with its shape, and
        nothing unknown is (ConfigError: which not); reads the headers only."""
        ...

    def with_seq_len(self, seq_len: int) -> "OpenedModel":
        """The model with a context of `seq_len` (ConfigError where its weights hold positions
        for fewer tokens)."""
        ...


class HFTensor(NamedTuple):
    """One Hugging Face tensor an export writes, from one of our parameters (one layer of it)."""

    name: str
    shape: tuple[int, ...]
    ours: str  # the parameter it comes from
    layer: int | None  # its layer, for a parameter stacked over layers
    # Our gathered tensor (that layer's), or None where we have no such parameter -> HF's.
    convert: Callable[[np.ndarray | None], np.ndarray]


class HFAdapter(Protocol):
    """A family of models to and from Hugging Face's form: configs and tensors, both ways."""

    def open(self, path: pathlib.Path) -> OpenedModel:
        """The directory's config.json as ours, checked (ConfigError: why not); no weights read."""
        ...

    def hf_config(
        self, config: Any, vocab: int, base: dict | None, dtype: str, eos_id: int | None
    ) -> dict:
        """config.json for `config` (HF vocabulary `vocab`), from the source's config.json
        `base` where there is one, its weights in `dtype`, EOS `eos_id`."""
        ...

    def from_hf(self, model: OpenedModel, targets: dict) -> dict:
        """name -> global array, read from the directory's safetensors a shard at a time, laid
        out as `targets` say (name -> ShapeDtypeStruct with sharding)."""
        ...

    def to_hf(self, config: Any, vocab: int) -> list[HFTensor]:
        """Every tensor of `config`'s Hugging Face form (HF vocabulary `vocab`), in order."""
        ...

    def from_record(self, fields: dict) -> "ModelSpec":
        """The model a run recorded (its config.json's "model"); ConfigError where this version
        does not know it."""
        ...
