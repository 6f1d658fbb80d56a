"""The compute term of a step, from the work it does and the hardware's calibrated figures.

One device's share of a step is priced as three kinds of work, each at the rate the hardware
reaches on it (hardware.toml, where each figure's source is written):

- weight matmuls (projections, MLP, output head): 6 FLOPs per parameter and token, at
  `matmul_efficiency` of peak for wide matmuls and less for narrow ones, since a matmul whose
  inner dimension w is small spends more of its time loading tiles than multiplying them:
  efficiency(w) = matmul_efficiency * w / (w + matmul_half_width), w the model width each
  device multiplies over (d_model, divided by the tensor axis);
- attention's QK^T and AV (12 L D T per token, forward and backward, the convention of the
  published figures): fused kernels (cuDNN's, splash) skip the blocks the causal mask hides,
  about half, and run at `attention_efficiency` of peak; XLA's own attention computes them all;
- element-wise work (norms, activations, residual adds, rotary embeddings, the loss's softmax,
  the optimizer update): memory-bound, so priced as bytes moved at `hbm_bandwidth`.

Rematerialization adds the forward FLOPs of what the policy recomputes: a share of each
layer's weight matmuls (models/remat.py's RECOMPUTE: 0 for dots, the MLP's share for
dots_except_mlp, 1 for full) and, where the policy reruns it, attention's forward. Published
MFU figures count none of it; the hardware runs all of it.
"""

import dataclasses
import math

from jaxdist.errors import ConfigError
from jaxdist.hardware import Hardware
from jaxdist.rules import logical_axes, variables

# Element-wise traffic per token and layer, forward and backward, in elements of the compute
# dtype (counted for one pre-norm layer as XLA fuses it): the forward reads and writes about
# 12 vectors of d_model (two norms, two residual adds, rotary q and k) and 3 of d_mlp (the
# activation reads the up and gate outputs and writes their product); the backward about twice
# that, and remat "dots" reruns the forward's share once more.
ELEMENTWISE_PER_D = 48
ELEMENTWISE_PER_F = 12
# The loss per token: fp32 logits written, read for the max and the sum, the softmax's gradient
# written and read back by the head's matmuls: about 6 passes of 4 bytes over the vocabulary.
LOSS_BYTES_PER_VOCAB = 24
# AdamW per parameter shard: fp32 parameter, two moments and the gradient read, three written.
OPTIMIZER_BYTES_PER_PARAM_BYTE = 7 / 4


@dataclasses.dataclass(frozen=True)
class Work:
    """What one layer and the head of a model multiply, per token (from its config)."""

    num_layers: int
    d_model: int
    d_mlp: int
    vocab: int
    seq_len: int
    attention_proj_params: int  # per layer: QKV and output projections
    mlp_params: int  # per layer, as a token sees them (MoE: its top_k experts)
    head_params: int  # the output head (tied or not), and any other matmul outside the layers
    # Share of each layer's forward weight-matmul FLOPs the backward pass reruns, and whether
    # it reruns attention's forward too (full remat; XLA's attention under any remat).
    recompute_matmul: float = 0.0
    recompute_attention: bool = False

    def __post_init__(self):
        if not 0 <= self.recompute_matmul <= 1:
            raise ConfigError(f"recomputed share {self.recompute_matmul} must lie in [0, 1]")

    @property
    def attention_flops(self) -> float:
        """QK^T and AV per token, forward and backward, without causal halving."""
        return 12 * self.num_layers * self.d_model * self.seq_len

    @property
    def matmul_flops(self) -> float:
        layer = self.attention_proj_params + self.mlp_params
        return 6 * (self.num_layers * layer + self.head_params)

    def recompute_flops(self) -> tuple[float, float]:
        """Extra forward FLOPs per token: (weight matmuls, attention) the policy reruns."""
        layers = self.num_layers * (self.attention_proj_params + self.mlp_params)
        mm = 2 * layers * self.recompute_matmul
        return mm, self.attention_flops / 3 if self.recompute_attention else 0.0


def work_of(model) -> Work:
    """The Work of a planner.PlanModel, read from its weights' logical axes: the projections
    are the layer weights over heads, the MLP's what its FLOPs per token leave of the layers'
    (a MoE token sees only its top_k experts), the head d_model x vocab."""
    L, D, T = model.num_layers, model.d_model, model.seq_len
    attention_proj = d_mlp = vocab = 0
    for var in variables(model.abstract_params):
        logical = logical_axes(var)
        if "layers" in logical and ({"heads", "kv_heads"} & set(logical)):
            attention_proj += math.prod(var.shape) // L
        if "mlp" in logical:
            d_mlp = var.shape[logical.index("mlp")]
        if "vocab" in logical:
            vocab = var.shape[logical.index("vocab")]
    matmul_params = (model.flops_per_token - 12 * L * D * T) / 6
    head = D * vocab
    return Work(
        num_layers=L,
        d_model=D,
        d_mlp=d_mlp,
        vocab=vocab,
        seq_len=T,
        attention_proj_params=attention_proj,
        mlp_params=round((matmul_params - head) / L) - attention_proj,
        head_params=head,
        recompute_matmul=model.recompute_matmul,
        recompute_attention=model.recompute_attention,
    )


def matmul_efficiency(hw: Hardware, width: float) -> float:
    return hw.matmul_efficiency * width / (width + hw.matmul_half_width)


def seconds(
    work: Work,
    tokens: float,
    hw: Hardware,
    tensor_ways: int = 1,
    compute_bytes: int = 2,
    param_bytes: float = 0.0,
    override: float | None = None,
) -> dict[str, float]:
    """Seconds one device spends on `tokens` tokens of the step (its share of the batch, times
    the layers it runs: the caller divides by pipeline stages), by kind of work.

    `param_bytes`: this device's fp32 parameter shard (the optimizer update reads it);
    `override`: one flat share of peak for every FLOP, and no element-wise term (the planner's
    `--compute-efficiency`)."""
    mm_extra, att_extra = work.recompute_flops()
    if override is not None:
        flops = (work.matmul_flops + work.attention_flops + mm_extra + att_extra) * tokens
        t = flops / tensor_ways / (hw.peak_flops * override)
        return {"matmul": t, "attention": 0.0, "elementwise": 0.0, "total": t}
    width = work.d_model / tensor_ways
    matmul = (work.matmul_flops + mm_extra) * tokens / tensor_ways
    matmul /= hw.peak_flops * matmul_efficiency(hw, width)
    # Fused kernels skip the masked half; XLA's attention (CPU) computes every block.
    causal = 1.0 if hw.platform == "cpu" else 0.5
    attention = (work.attention_flops + att_extra) * causal * tokens / tensor_ways
    attention /= hw.peak_flops * hw.attention_efficiency
    elementwise = 0.0
    if hw.hbm_bandwidth:
        per_layer = ELEMENTWISE_PER_D * work.d_model + ELEMENTWISE_PER_F * work.d_mlp
        moved = work.num_layers * per_layer * compute_bytes / tensor_ways
        moved += LOSS_BYTES_PER_VOCAB * work.vocab / tensor_ways
        elementwise = (moved * tokens + OPTIMIZER_BYTES_PER_PARAM_BYTE * param_bytes) / (
            hw.hbm_bandwidth
        )
    total = matmul + attention + elementwise
    return {"matmul": matmul, "attention": attention, "elementwise": elementwise, "total": total}
