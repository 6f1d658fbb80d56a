"""What the trainer needs to know of a model: the contract between models/ and the loop.

Any Flax NNX module whose parameters declare `logical_axes` (LOGICAL_AXES below) and whose call
`model(tokens_BT, docs=None) -> (logits_BTV, aux)` maps tokens [B, T] to logits [B, T, V] fits:
aux holds `loss` (added to the objective, e.g. MoE balance) and `metrics` (logged), and may
hold `expert_load` ({parameter name: expert loads [L, E]}: the step moves those parameters, a
router's jaxdist.optim.ExpertBias, by them). The step
passes `docs` (second argument; jaxdist.kernels.documents.Documents: per-token document ids and
positions) only when rows are packed documents and document masking is on; the model then
keeps every document to itself (no attention or mixing across a boundary, positions restarting
at each). Otherwise it calls `model(tokens_BT)`: one causal sequence per row. models/ supplies
specs for its presets; a script may supply its own (see experiments/own_model.py).

Optional, for memory: `model.features(tokens_BT, docs=None) -> (h_BTD, head_DV, aux)`, the last
hidden state and the output head (logits = h_BTD @ head_DV). A model that has it gets the fused
cross-entropy (jaxdist.kernels.fused_loss: the logits computed chunk by chunk, never whole in
memory); one that has not is called for its logits. Optional, for pipeline parallelism:
`model.stages()` (`Stages` below; jaxdist.parallel.pipeline runs them). Optional, for
multi-token prediction (training only): `model.mtp_depth` > 0, `model.mtp_loss_weight` and
`model.ahead(tokens_BT, targets_BT, docs) -> (h_BTD, head_DV, aux, depths)`, depths a list of
(h_BTD, targets_BT, mask_BT) per depth (jaxdist.kernels.loss.model_loss adds their loss).

Models never name mesh axes; they name each dimension with one of the logical names in
LOGICAL_AXES, and a rule table (jaxdist.rules) maps each name onto zero or more mesh axes.
Shape-suffix legend used throughout the code (x_BTD, logits_BTV, ...):
  B batch      T seq (sequence position)   D embed      F mlp (hidden width)
  N heads      G kv_heads   Q qkv (query heads of a kv group, then K, then V)
  H head_dim   V vocab      L layers     E expert     C capacity (slots per expert)
  K top-k choices of the router
"""

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # the contract names flax's types; reading it (a layout, a flag) loads none
    from flax import nnx

# The closed vocabulary of logical axes that models name their tensors' dimensions with.
LOGICAL_AXES: tuple[str, ...] = (
    "batch",
    "seq",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "qkv",
    "head_dim",
    "vocab",
    "layers",
    "expert",
)


class ModelSpec(NamedTuple):
    name: str
    init: Callable[["nnx.Rngs"], "nnx.Module"]
    seq_len: int
    vocab_size: int
    flops_per_token: float  # training FLOPs per token, for MFU
    config: Any = None  # a dataclass, recorded in the run directory
    # For generation (jaxdist/inference/generate.py): compute dtype -> the model run with a KV
    # cache (a jaxdist.inference.generate.Decoder, not imported: the model contract comes before
    # everything that runs a model). None: the model has no decoder.
    decoder: Callable[[str], Any] | None = None
    # The sizes the tensor mesh axis splits, each a multiple of its ways: generation takes the
    # widest tensor axis they allow (jaxdist/hf/generation.py). (): none.
    tensor_dims: tuple[int, ...] = ()


class Stages(NamedTuple):
    """A model cut into pipeline pieces (supplied by the model)."""

    weights: dict  # name -> array, as stored
    layer_keys: list[str]  # stacked per-layer weights, split over the pipeline axis
    embed: Callable  # (weights, tokens_bT, docs: Documents | None) -> x_bTD
    body: Callable  # (layer weights, x_bTD, docs) -> (x_bTD, auxiliary loss share)
    head: Callable  # (weights, x_bTD) -> logits_bTV
    axes: dict  # name -> the weight's logical axes (LOGICAL_AXES)
    compute_dtype: str = "float32"  # weights are gathered in it
    # (weights, x_bTD) -> (h_bTD, head_DV), logits = h @ head: for the fused loss, which never
    # holds a microbatch's whole logits (jaxdist.kernels.fused_loss); None: the loss takes `head`'s.
    features: Callable | None = None


def param_count(shapes: Iterable[tuple[int, ...]]) -> int:
    """Parameters of a model whose weights have these shapes: all of them, embeddings and head
    included (the figure peers report; FP8 scales and histories are state, not weights). The
    step counts its parameter tree, the planner its abstract one, a model config its table."""
    return sum(math.prod(shape) for shape in shapes)
