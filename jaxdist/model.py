"""What the trainer needs to know of a model: the contract between models/ and the loop.

Any Flax NNX module whose parameters declare `logical_axes` (jaxdist.axes) and whose call maps
tokens [B, T] to (logits [B, T, V], aux) fits: aux holds `loss` (added to the objective, e.g.
MoE balance) and `metrics` (logged). models/ supplies specs for its presets; a script may
supply its own (see experiments/own_model.py).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

from flax import nnx


class ModelSpec(NamedTuple):
    name: str
    init: Callable[[nnx.Rngs], nnx.Module]
    seq_len: int
    vocab_size: int
    flops_per_token: float  # training FLOPs per token, for MFU
    config: Any = None  # a dataclass, recorded in the run directory
