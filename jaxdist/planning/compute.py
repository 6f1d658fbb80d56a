"""The compute term of a step, from the shapes of the work it does and the hardware's figures.

One device's share of a step is priced as three kinds of work, each at the rate the hardware
reaches on it (hardware.toml, where each figure's source is written):

- weight matmuls, each by its own shape: a weight of K x N (its contracted and produced widths,
  read from its logical axes; the `tensor` axis splits the one that is not `embed`) runs its
  forward and two backward GEMMs, 6 FLOPs per weight and token, at
  `matmul_efficiency * w / (w + matmul_half_width)` of peak, w = min(K, N) on the device: a
  GEMM whose narrow side is small spends more of its time loading tiles than multiplying them
  (the GQA model's key and value projection, a tensor-split MLP). Experts multiply every slot
  of their capacity, filled or not;
- attention's QK^T and AV (12 L D T per token, forward and backward, the convention of the
  published figures): fused kernels (cuDNN's, splash) skip the blocks the causal mask hides,
  about half, and run at `attention_efficiency` of peak; XLA's own attention computes them all;
- element-wise work (norms, activations, residual adds, rotary embeddings, the loss's softmax,
  the optimizer update): memory-bound, so priced as bytes moved at `hbm_bandwidth`, the passes
  a framework makes over each tensor (`elementwise_passes` times the fused count below).

With --fp8, the projections planning.fp8 admits run their three GEMMs at the FP8 peak, on the
same efficiency curve, and their operands' casts are priced as HBM traffic (fp8_cast_bytes).

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
# dtype, as XLA fuses it (counted for one pre-norm layer): the forward reads and writes about
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
# The axes a weight's matmul contracts or produces beside `embed`; `layers` and `expert` are
# batch dims of the stacked weights, not matmul dims.
_STACKED = ("layers", "expert")
_MATMUL = {"mlp", "heads", "kv_heads", "qkv", "head_dim"}


@dataclasses.dataclass(frozen=True)
class Matmul:
    """A weight a token multiplies: `weights` of them per token (a layer's times the layers; an
    expert's times the slots a token fills), between `embed` elements and `other` ones."""

    weights: float
    embed: int
    other: int
    in_layers: bool  # rerun by the remat policy's share (the head is not)
    # The forward GEMM reads `embed` and writes `other` (q, k, v, the MLP's up and gate; the
    # head); False: it writes `embed` (attention's output, the MLP's down projection).
    embed_in: bool = True
    expert: bool = False
    # Its GEMMs run on FP8 operands (planning.fp8 admits it): at the FP8 peak, plus the casts.
    fp8: bool = False

    def width(self, tensor_ways: int) -> float:
        """The GEMM's narrow side on one device: the side that is not `embed` is split over
        the tensor axis (Megatron: column then row parallel)."""
        return min(self.embed, self.other / tensor_ways)


@dataclasses.dataclass(frozen=True)
class Work:
    """What one token of a model multiplies and moves (from its weights' logical axes)."""

    num_layers: int
    d_model: int
    d_mlp: int
    vocab: int
    seq_len: int
    attention_width: int  # heads x head_dim: what QK^T and AV multiply per position
    matmuls: tuple[Matmul, ...]
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
        return 12 * self.num_layers * self.attention_width * self.seq_len

    @property
    def matmul_flops(self) -> float:
        return 6 * sum(m.weights for m in self.matmuls)

    def recompute_flops(self) -> tuple[float, float]:
        """Extra forward FLOPs per token: (weight matmuls, attention) the policy reruns."""
        layers = sum(m.weights for m in self.matmuls if m.in_layers)
        mm = 2 * layers * self.recompute_matmul
        return mm, self.attention_flops / 3 if self.recompute_attention else 0.0


def work_of(model) -> Work:
    """The Work of a planner.PlanModel, read from its weights' logical axes: every weight with
    `embed` and another matmul axis is a matmul (norm scales and biases are not; the embedding
    table is a lookup, but where it is also the head); experts' per-token share is the slots a
    token fills of them (top_k of num_experts, times `model.expert_slots`)."""
    L, D = model.num_layers, model.d_model
    matmuls, d_mlp, vocab, attention_width = [], 0, 0, D
    tables = {}
    for var in variables(model.abstract_params):
        logical = logical_axes(var)
        named = [(n, s) for n, s in zip(logical, var.shape, strict=True) if n is not None]
        dims = [(n, s) for n, s in named if n not in _STACKED]
        tables[tuple(n for n, _ in dims)] = var
        if "mlp" in logical:
            d_mlp = var.shape[logical.index("mlp")]
        if "vocab" in logical:
            vocab = var.shape[logical.index("vocab")]
        if "heads" in logical and "head_dim" in logical and "layers" in logical:
            heads = var.shape[logical.index("heads")] * var.shape[logical.index("head_dim")]
            attention_width = heads
        names = [n for n, _ in dims]
        others = set(names) - {"embed"}
        head = names == ["embed", "vocab"]
        # Weights of embed and matmul axes; not norm scales, biases, position or token tables.
        if "embed" not in names or not others or not (head or others <= _MATMUL):
            continue
        other = math.prod(s for n, s in dims if n != "embed")
        weights = math.prod(s for _, s in named)
        if "expert" in logical:
            experts = var.shape[logical.index("expert")]
            weights = weights / experts * model.top_k * model.expert_slots
        expert = "expert" in logical
        matmuls.append(Matmul(weights, D, other, "layers" in logical, names[0] == "embed", expert))
    if ("embed", "vocab") not in tables and ("vocab", "embed") in tables:  # a tied head
        matmuls.append(Matmul(D * vocab, D, vocab, False))
    return Work(
        num_layers=L,
        d_model=D,
        d_mlp=d_mlp,
        vocab=vocab,
        seq_len=model.seq_len,
        attention_width=attention_width,
        matmuls=tuple(matmuls),
        recompute_matmul=model.recompute_matmul,
        recompute_attention=model.recompute_attention,
    )


def _passes(work: Work, m: Matmul) -> float:
    """FLOPs per weight and token: forward and two backward GEMMs, and the remat policy's
    rerun of the forward."""
    return 6 + (2 * work.recompute_matmul if m.in_layers else 0)


def matmul_efficiency(hw: Hardware, width: float) -> float:
    return hw.matmul_efficiency * width / (width + hw.matmul_half_width)


# Bytes moved per element of a tensor cast to FP8: a pass reads it for its amax, a second reads it
# again and writes one byte (the scale needs the amax first). Delayed scaling could fold the
# amax into the cast's pass where XLA fuses them; priced alike.
def _cast_bytes_per_element(compute_bytes: int) -> int:
    return 2 * compute_bytes + 1


def fp8_cast_bytes(
    work: Work, tokens: float, tensor_ways: int, compute_bytes: int, weight_passes: float
) -> float:
    """HBM bytes one device moves casting its FP8 projections' operands, per step: each of a
    projection's three tensors (input, weight, output gradient) is cast once and its FP8 copy
    read by both GEMMs that take it (flax's direct FP8 op keeps the casts for the backward);
    the FP8 outputs are rescaled in the GEMMs' epilogues, free. The `embed` side of a GEMM is
    whole on every tensor-parallel device, the other side split. The forward's casts rerun
    where the remat policy reruns the forward; a layer's weights are cast `weight_passes`
    times a step (microbatches over pipeline stages)."""
    total = 0.0
    for m in work.matmuls:
        if not m.fp8:
            continue
        layers = m.weights / (m.embed * m.other)
        rerun = 1 + (work.recompute_matmul if m.in_layers else 0.0)
        embed, other = m.embed, m.other / tensor_ways
        x_width, g_width = (embed, other) if m.embed_in else (other, embed)
        activations = tokens * layers * (rerun * x_width + g_width)
        weights = layers * embed * other * weight_passes * rerun
        total += activations + weights
    return total * _cast_bytes_per_element(compute_bytes)


def seconds(
    work: Work,
    tokens: float,
    hw: Hardware,
    tensor_ways: int = 1,
    compute_bytes: int = 2,
    param_bytes: float = 0.0,
    override: float | None = None,
    weight_passes: float = 1.0,
) -> dict[str, float]:
    """Seconds one device spends on `tokens` tokens of the step (its share of the batch, times
    the layers it runs: the caller divides by pipeline stages), by kind of work.

    `param_bytes`: this device's fp32 parameter shard (the optimizer update reads it);
    `override`: one flat share of peak for every FLOP, and no element-wise term (the planner's
    `--compute-efficiency`); `weight_passes`: how often a step runs a layer's weights through
    a device (FP8 casts them each time). Matmuls marked fp8 run at the FP8 peak, scaled as
    bf16's; `fp8_cast` is their operands' casts, at HBM bandwidth."""
    mm_extra, att_extra = work.recompute_flops()
    if override is not None:
        # FP8 GEMMs' FLOPs at the same flat share of the FP8 peak.
        fp8 = sum(_passes(work, m) * m.weights for m in work.matmuls if m.fp8)
        flops = work.matmul_flops + work.attention_flops + mm_extra + att_extra - fp8
        t = flops / hw.peak_flops + (fp8 / hw.fp8_peak_flops if fp8 else 0.0)
        t *= tokens / tensor_ways / override
        return {"matmul": t, "attention": 0.0, "elementwise": 0.0, "fp8_cast": 0.0, "total": t}
    matmul = 0.0
    for m in work.matmuls:
        passes = _passes(work, m)
        peak = hw.fp8_peak_flops if m.fp8 else hw.peak_flops
        rate = peak * matmul_efficiency(hw, m.width(tensor_ways))
        matmul += passes * m.weights * tokens / tensor_ways / rate
    # Fused kernels skip the masked half; XLA's attention (CPU) computes every block.
    causal = 1.0 if hw.platform == "cpu" else 0.5
    attention = (work.attention_flops + att_extra) * causal * tokens / tensor_ways
    attention /= hw.peak_flops * hw.attention_efficiency
    elementwise = 0.0
    if hw.hbm_bandwidth:
        per_layer = ELEMENTWISE_PER_D * work.d_model + ELEMENTWISE_PER_F * work.d_mlp
        moved = work.num_layers * per_layer * compute_bytes / tensor_ways
        moved += LOSS_BYTES_PER_VOCAB * work.vocab / tensor_ways
        moved *= hw.elementwise_passes
        elementwise = (moved * tokens + OPTIMIZER_BYTES_PER_PARAM_BYTE * param_bytes) / (
            hw.hbm_bandwidth
        )
    cast = 0.0
    if any(m.fp8 for m in work.matmuls):
        cast = fp8_cast_bytes(work, tokens, tensor_ways, compute_bytes, weight_passes)
        cast /= hw.hbm_bandwidth
    total = matmul + attention + elementwise + cast
    return {
        "matmul": matmul,
        "attention": attention,
        "elementwise": elementwise,
        "fp8_cast": cast,
        "total": total,
    }
