"""The transformer's configuration (models/transformer.py): its sizes and options, the checks
a config must pass, and the shapes of its parameters.

Legend: as models/transformer.py.
"""

import dataclasses
import math
from typing import Literal

from jaxdist.errors import ConfigError
from jaxdist.model import param_count
from models import rope

# The names of models/remat.py's policies (its POLICIES), read by the flags without jax.
RematPolicy = Literal["none", "full", "dots", "dots_except_mlp", "offload"]

# A MoE layer's weights (models/moe.py): the router, and each expert's SwiGLU, stacked over E.
EXPERT_WEIGHTS = ("w_up_LEDF", "w_gate_LEDF", "w_down_LEFD")
# The dense first layers of a MoE model (dense_layers): a stack of their own, each weight named
# as the MoE stack's with this prefix (dense_norm1_scale_LD, dense_w_up_LDF, ...).
DENSE = "dense_"
# The multi-token prediction modules (mtp_depth): a stack of their own, one per depth, each
# block's weights named as the last stack's with this prefix (mtp_wo_LNHD, mtp_w_up_LEDF, ...),
# beside each module's norms and projection (mtp_shapes).
MTP = "mtp_"


def moe_shapes(L: int, D: int, F: int, E: int) -> dict[str, tuple[int, ...]]:
    return {
        "router_LDE": (L, D, E),
        "w_up_LEDF": (L, E, D, F),
        "w_gate_LEDF": (L, E, D, F),
        "w_down_LEFD": (L, E, F, D),
    }


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    name: str
    style: Literal["gpt2", "llama"]
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    d_mlp: int
    vocab_size: int
    seq_len: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    # Biases on the attention (QKV, output) and MLP linear layers: GPT-2 has both, Llama
    # neither by default (its attention_bias / mlp_bias). The presets keep them off.
    attention_bias: bool = False
    mlp_bias: bool = False
    # The output projection's bias; None: as attention_bias (Qwen2 biases Q, K, V only).
    attention_out_bias: bool | None = None
    # Per-head width when it is not d_model / num_heads (Qwen3); 0: d_model / num_heads. Not
    # stored as head_dim itself: a preset with d_model overridden must not keep a stale one.
    head_dim_override: int = 0
    # RMSNorm of each query and key head (weights [head_dim]) before RoPE (Qwen3).
    qk_norm: bool = False
    # RoPE scaling (models/rope.py): the HF rope_parameters' items but rope_theta; () plain.
    rope_scaling: tuple = ()
    # Sliding-window attention's window (Mistral v0.1); 0: none. Only lengths the window
    # covers whole are supported, where full causal attention computes the same.
    sliding_window: int = 0
    # The output head is the token embedding transposed (GPT-2, small Llamas): no head_DV.
    tie_embeddings: bool = False
    compute_dtype: str = "float32"
    # A policy of models/remat.py: none keeps all activations, full recomputes each layer in
    # the backward pass, dots keeps matmul and attention-kernel outputs, dots_except_mlp all
    # but the MLP's, offload dots' set in host memory.
    remat: RematPolicy = "none"
    # The attention kernel (jaxdist.kernels.attention): cudnn on GPUs, splash on TPUs, xla anywhere.
    attention: Literal["xla", "cudnn", "splash"] = "xla"
    # Mixture of experts (every layer's MLP) when num_experts > 0; d_mlp is each expert's.
    num_experts: int = 0
    top_k: int = 2
    # None: dropless (every routed token runs; with experts split over devices each device's
    # receive buffer holds moe_buffer_factor x its balanced share, rows past it dropped and
    # counted in moe_dropped: jaxdist.parallel.dropless). A factor: capacity mode, each expert
    # takes factor x tokens x top-k / experts per device, the rest dropped (Switch, GShard).
    capacity_factor: float | None = None
    moe_buffer_factor: float = 1.25
    # The experts' grouped GEMM (jaxdist.kernels.grouped_gemm): auto (JAX's Pallas Mosaic GPU
    # kernels on Hopper GPUs, XLA's ragged dot elsewhere), xla or pallas.
    moe_gemm: Literal["auto", "xla", "pallas"] = "auto"
    moe_impl: Literal["dispatch", "dense"] = "dispatch"
    # The chosen experts' weights renormalized to sum to 1 (Mixtral; Qwen3-MoE's
    # norm_topk_prob), else their router probabilities as they are.
    moe_renormalize: bool = True
    balance_coef: float = 0.01
    z_loss_coef: float = 0.001
    # Multi-head latent attention (DeepSeek-V2/V3; models/mla.py) where kv_lora_rank > 0, named
    # as Hugging Face's DeepseekV3Config: keys and values from a compressed latent of
    # kv_lora_rank plus one RoPE key of qk_rope_head_dim shared by the heads; queries through a
    # rank of q_lora_rank (0: a plain projection, as DeepSeek-V2-Lite's None). A head's q.k is
    # qk_nope_head_dim + qk_rope_head_dim wide, its value v_head_dim (head_dim, what the output
    # projection reads). rope_interleave: the RoPE part's rotated pairs are adjacent columns.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # The router (models/routing.py; names as HF's DeepseekV3 config): softmax or sigmoid
    # scores; n_group groups of experts of which each token's choice spans its best topk_group;
    # the weights times routed_scaling_factor.
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # A per-layer, per-expert bias added to the scores to choose experts, never to weigh them
    # (HF's e_score_correction_bias), and the rate the step moves it at from the experts'
    # loads, outside the gradient (aux-loss-free balancing, jaxdist.optim; DeepSeek-V3:
    # 0.001); 0: the bias stays as loaded.
    router_bias: bool = False
    bias_update_rate: float = 0.0
    # A shared expert for every token, a SwiGLU of n_shared_experts x d_mlp (DeepSeek) or of
    # shared_expert_intermediate_size (Qwen2-MoE, whose shared_expert_gate scales it by a
    # sigmoid of the token).
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # MoE models only: the first dense_layers layers have a dense SwiGLU MLP of dense_d_mlp
    # (DeepSeek-V3's first_k_dense_replace and intermediate_size; 0: d_mlp), the rest MoE.
    # They are stacked and scanned apart (stacks below).
    dense_layers: int = 0
    dense_d_mlp: int = 0
    # Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 section 2.2; HF's
    # num_nextn_predict_layers): mtp_depth sequential modules, module k predicting token t+k+1
    # from module k-1's hidden state (the trunk's before its final norm for k = 1) and the
    # embedding of token t+k, through one block of the model's last kind (MoE where the model
    # is), the embedding and head shared. Training adds mtp_loss_weight / mtp_depth x their
    # cross-entropies to the loss (DeepSeek-V3: 0.3, later 0.1); generation and evaluation
    # never run them.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    def __post_init__(self):
        # A recorded config (JSON) gives lists: the tuple a frozen, hashable config needs.
        object.__setattr__(self, "rope_scaling", tuple(tuple(kv) for kv in self.rope_scaling))
        rope.check_length(self.rope_scaling, self.seq_len)
        if self.sliding_window and self.seq_len > self.sliding_window:
            raise ConfigError(
                f"sliding-window attention is not supported: the model attends "
                f"{self.sliding_window} tokens back, and {self.seq_len} is longer; pass "
                f"--seq-len {self.sliding_window} or less"
            )
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise ConfigError(f"top-k {self.top_k} must lie in [1, {self.num_experts} experts]")
            if self.capacity_factor is not None and not self.capacity_factor > 0:
                raise ConfigError(f"capacity factor {self.capacity_factor} must be > 0")
            if not self.moe_buffer_factor >= 1:
                raise ConfigError(
                    f"MoE buffer factor {self.moe_buffer_factor} must be at least 1 (the "
                    "balanced share)"
                )
            if self.mlp_bias:
                raise ConfigError("MLP biases with MoE layers are not supported; drop mlp_bias")
            _check_routing(self)
        _check_dense_layers(self)
        _check_mtp(self)
        if self.mla:
            _check_mla(self)
        elif self.d_model % self.num_heads and not self.head_dim_override:
            raise ValueError(f"d_model {self.d_model} not divisible by heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"heads {self.num_heads} not divisible by kv_heads {self.num_kv_heads}"
            )

    @property
    def shared_width(self) -> int:
        """The shared expert's hidden width; 0: none."""
        return self.shared_expert_intermediate_size or self.n_shared_experts * self.d_mlp

    @property
    def head_dim(self) -> int:
        if self.mla:  # the width the output projection reads: a head's value
            return self.v_head_dim
        return self.head_dim_override or self.d_model // self.num_heads

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def out_bias(self) -> bool:
        return self.attention_bias if self.attention_out_bias is None else self.attention_out_bias

    @property
    def qk_head_dim(self) -> int:
        """MLA: a head's query and key width, the latent's part and the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def num_params(self) -> int:
        """All parameters, embeddings included (jaxdist.model.param_count)."""
        return param_count(_param_shapes(self).values())

    def flops_per_token(self) -> float:
        """Training FLOPs per token, PaLM formula: 6*N + 12*L*D*T.

        N counts the weight matrices (attention, MLP and output head), not the input or
        position embeddings, which are lookups; 12*L*D*T is attention's QK^T and AV, forward and
        backward, without causal halving (the convention published MFU figures use). The
        multi-token prediction modules count as training runs them: their blocks' and
        projections' weights, the shared head once more per depth, attention per depth.
        """
        shapes = _param_shapes(self)
        # MoE: each token passes through top_k of the experts, so count those (MFU on active
        # parameters, the convention MoE results are published with).
        active = self.top_k / self.num_experts if self.num_experts else 1.0
        n = sum(
            math.prod(s) * (active if k.removeprefix(MTP) in EXPERT_WEIGHTS else 1)
            for k, s in shapes.items()
            if len(s) >= 3 or k == "head_DV"
        )
        if self.tie_embeddings:  # the head's matmul is there, its weight is the embedding's
            n += self.d_model * self.vocab_size
        n += self.mtp_depth * self.d_model * self.vocab_size  # each depth's pass of the head
        attn_width = self.num_heads * self.head_dim  # d_model unless head_dim is set apart
        if self.mla:  # QK^T over the q.k width, AV over the value's
            attn_width = self.num_heads * (self.qk_head_dim + self.v_head_dim) / 2
        layers = self.num_layers + self.mtp_depth
        return 6 * n + 12 * layers * attn_width * self.seq_len


def _check_dense_layers(c: TransformerConfig) -> None:
    if not c.dense_layers and not c.dense_d_mlp:
        return
    if not c.num_experts:
        raise ConfigError(
            f"dense_layers {c.dense_layers} (dense first layers) needs MoE layers after them; "
            "this model has no experts (every layer is dense already)"
        )
    if not 0 <= c.dense_layers < c.num_layers:
        raise ConfigError(
            f"dense_layers {c.dense_layers} must lie in [0, {c.num_layers} layers): at least "
            "one layer must be MoE"
        )
    if c.dense_d_mlp < 0:
        raise ConfigError(f"dense_d_mlp {c.dense_d_mlp} must be >= 0 (0: d_mlp)")


def _check_mtp(c: TransformerConfig) -> None:
    if c.mtp_depth < 0 or not c.mtp_loss_weight >= 0:
        raise ConfigError(
            "multi-token prediction needs mtp_depth (--mtp-depth) >= 0 (0: none) and "
            f"mtp_loss_weight (--mtp-loss-weight) >= 0; "
            f"got mtp_depth {c.mtp_depth}, mtp_loss_weight {c.mtp_loss_weight}"
        )
    if c.mtp_depth and c.style != "llama":
        raise ConfigError(
            f"multi-token prediction (mtp_depth {c.mtp_depth}) is built for llama-style "
            "models (RMSNorm, no learned positions); set mtp_depth 0 (--mtp-depth 0)"
        )


def stacks(c: TransformerConfig) -> list[tuple[str, TransformerConfig]]:
    """The model's layer stacks in order, each with its weights' name prefix and the config of
    its layers alone: one (every layer alike) or, with dense_layers, the dense first layers
    ("dense_", no experts, dense_d_mlp wide) then the MoE ones. The multi-token prediction
    modules are not among them (mtp_block)."""
    if c.mtp_depth:  # the stacks' configs are of their layers alone
        c = dataclasses.replace(c, mtp_depth=0)
    if not c.dense_layers:
        return [("", c)]
    rest = dict(num_layers=c.num_layers - c.dense_layers, dense_layers=0, dense_d_mlp=0)
    dense = rest | dict(num_layers=c.dense_layers, num_experts=0, d_mlp=c.dense_d_mlp or c.d_mlp)
    return [
        (DENSE, dataclasses.replace(c, **dense)),
        ("", dataclasses.replace(c, **rest)),
    ]


def mtp_block(c: TransformerConfig) -> TransformerConfig:
    """The config of the multi-token prediction modules' blocks, one per depth: the last
    stack's kind of layer (DeepSeek-V3's MoE layer where the model has dense first layers)."""
    return dataclasses.replace(stacks(c)[-1][1], num_layers=c.mtp_depth)


def mtp_shapes(c: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """The multi-token prediction modules' weights, stacked over the depths (L = mtp_depth):
    each block's (mtp_block, prefixed MTP); the RMSNorms of the embedding (HF's enorm) and of
    the previous depth's hidden state (hnorm); the projection of the two, concatenated
    (I = 2 D: [enorm(e); hnorm(h)], HF's eh_proj); the norm before the shared head
    (shared_head.norm)."""
    if not c.mtp_depth:
        return {}
    L, D = c.mtp_depth, c.d_model
    block = {MTP + k: s for k, s in _param_shapes(mtp_block(c)).items() if "_L" in k}
    return block | {
        MTP + "enorm_scale_LD": (L, D),
        MTP + "hnorm_scale_LD": (L, D),
        MTP + "eh_proj_LID": (L, 2 * D, D),
        MTP + "head_norm_scale_LD": (L, D),
    }


def stack_size(c: TransformerConfig, name: str) -> int:
    """How many layers the stacked weight `name` holds (its stack's)."""
    if name.startswith(MTP):
        return c.mtp_depth
    if not c.dense_layers:
        return c.num_layers
    return c.dense_layers if name.startswith(DENSE) else c.num_layers - c.dense_layers


def _check_mla(c: TransformerConfig) -> None:
    if c.style != "llama" or c.num_kv_heads != c.num_heads:
        raise ConfigError(
            f"latent attention (kv_lora_rank {c.kv_lora_rank}) needs the llama style and one kv "
            f"head per query head (num_kv_heads {c.num_kv_heads}, num_heads {c.num_heads})"
        )
    if c.attention_bias or c.qk_norm:
        raise ConfigError("latent attention with attention biases or q/k norms is not supported")
    if c.qk_rope_head_dim <= 0 or c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim {c.qk_rope_head_dim} must be even and > 0")
    if not 0 < c.v_head_dim <= c.qk_head_dim:
        # Attention runs with the values padded to the q.k width (jaxdist.parallel.attention).
        raise ConfigError(
            f"v_head_dim {c.v_head_dim} must lie in [1, qk_nope_head_dim + qk_rope_head_dim "
            f"= {c.qk_head_dim}]"
        )


def mla_shapes(c: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Latent attention's weights (models/mla.py's legend) in place of the fused QKV."""
    L, D, N, C, R = c.num_layers, c.d_model, c.num_heads, c.kv_lora_rank, c.q_lora_rank
    P, K, W = c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    shapes = {
        "wkv_a_LDA": (L, D, C + P),
        "kv_a_norm_scale_LC": (L, C),
        "wkv_b_LCNX": (L, C, N, K + W),
    }
    if not R:
        return {"wq_LDNU": (L, D, N, K + P)} | shapes
    return {"wq_a_LDR": (L, D, R), "q_a_norm_scale_LR": (L, R), "wq_b_LRNU": (L, R, N, K + P)} | (
        shapes
    )


def _check_routing(c: TransformerConfig) -> None:
    """The router's settings (models/routing.py), each wrong one refused in one line."""
    E, G = c.num_experts, c.n_group
    if c.scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"router scoring {c.scoring!r} must be softmax or sigmoid")
    if G < 1 or E % G:
        raise ConfigError(f"n_group {G} must divide the {E} experts into equal groups")
    if not 1 <= c.topk_group <= G:
        raise ConfigError(f"topk_group {c.topk_group} must lie in [1, {G} groups (n_group)]")
    if c.top_k > c.topk_group * (E // G):
        raise ConfigError(
            f"top-k {c.top_k} is more experts than the {c.topk_group} chosen groups hold "
            f"({c.topk_group} x {E // G}); raise topk_group or lower top_k"
        )
    if c.bias_update_rate < 0 or (c.bias_update_rate and not c.router_bias):
        raise ConfigError(
            f"bias_update_rate {c.bias_update_rate} needs router_bias and must be >= 0"
        )
    if c.n_shared_experts < 0 or (c.n_shared_experts and c.shared_expert_intermediate_size):
        raise ConfigError(
            "give the shared expert's width once: n_shared_experts (x d_mlp) or "
            "shared_expert_intermediate_size, not both (and neither below 0)"
        )
    if c.shared_expert_gate and not c.shared_width:
        raise ConfigError("shared_expert_gate gates a shared expert; this model has none")


def _param_shapes(c: TransformerConfig) -> dict[str, tuple[int, ...]]:
    if c.mtp_depth:  # the model's own weights, then the prediction modules'
        return _param_shapes(dataclasses.replace(c, mtp_depth=0)) | mtp_shapes(c)
    if c.dense_layers:  # the MoE stack's weights and the dense stack's, prefixed
        (prefix, dense), (_, rest) = stacks(c)
        shapes = _param_shapes(rest)
        return shapes | {prefix + k: s for k, s in _param_shapes(dense).items() if "_L" in k}
    L, D, F, N, G, H, V = (
        c.num_layers,
        c.d_model,
        c.d_mlp,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
    )
    shapes = {
        "tok_embed_VD": (V, D),
        "head_DV": (D, V),
        "norm_f_scale_D": (D,),
        "wqkv_LDGQH": (L, D, G, N // G + 2, H),
        "wo_LNHD": (L, N, H, D),
        "norm1_scale_LD": (L, D),
        "norm2_scale_LD": (L, D),
        "w_up_LDF": (L, D, F),
        "w_down_LFD": (L, F, D),
    }
    if c.tie_embeddings:
        del shapes["head_DV"]
    if c.mla:
        del shapes["wqkv_LDGQH"]
        shapes |= mla_shapes(c)
    if c.attention_bias:
        shapes["bias_qkv_LGQH"] = (L, G, N // G + 2, H)
    if c.out_bias:
        shapes["bias_o_LD"] = (L, D)
    if c.qk_norm:
        shapes |= {"q_norm_scale_LH": (L, H), "k_norm_scale_LH": (L, H)}
    if c.mlp_bias:
        shapes |= {"bias_up_LF": (L, F), "bias_down_LD": (L, D)}
        if c.style == "llama":
            shapes["bias_gate_LF"] = (L, F)
    if c.num_experts:
        for k in ("w_up_LDF", "w_down_LFD"):
            del shapes[k]
        shapes |= moe_shapes(L, D, F, c.num_experts)
        if c.router_bias:
            shapes["expert_bias_LE"] = (L, c.num_experts)
        if S := c.shared_width:
            shapes |= {
                "shared_w_up_LDF": (L, D, S),
                "shared_w_gate_LDF": (L, D, S),
                "shared_w_down_LFD": (L, S, D),
            }
        if c.shared_expert_gate:
            shapes["shared_gate_LD1"] = (L, D, 1)
    if c.style == "gpt2":
        shapes |= {
            "pos_embed_TD": (c.seq_len, D),
            "norm_f_bias_D": (D,),
            "norm1_bias_LD": (L, D),
            "norm2_bias_LD": (L, D),
        }
    elif not c.num_experts:
        shapes["w_gate_LDF"] = (L, D, F)
    return shapes
