"""The map between Hugging Face tensors and the stacked, fused parameters of
models/transformer.py, for every architecture models/hf_config.py reads.

Legend: as models/transformer.py (L layers, D embed, F mlp, N heads, G kv groups, QG query heads
per group, H head_dim, V vocab, E experts).

Every Hugging Face tensor is one of ours (one layer of it, for layer weights) under a reshape
and a transpose: its dims, each split into factors, are our dims in another order (`Piece`).
That one description serves both ways: import reads the block of each HF tensor that a device's
shard needs (whole heads, a range of rows or columns) and transposes it into place; export
transposes a gathered tensor back. Some of ours are several HF tensors side by side along one
axis (`rows`): the fused QKV weight is Llama's q, k and v projections (GPT-2's c_attn already is
[q|k|v]), and an expert-stacked MoE weight is one HF tensor per expert.
Our vocabulary is padded to a multiple of 128: padded rows load as zeros and are cut on export.
"""

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from jaxdist.errors import ConfigError
from models.transformer_config import DENSE, MTP, TransformerConfig, mtp_block, stacks


class Piece(NamedTuple):
    """One HF tensor (`{l}` in the name: one per layer) as one of our parameters (per layer).

    factors: each HF dim split into factors (row-major); perm: our dims, each given as the
    index of its factor among all factors in order; rows: for a parameter assembled from
    several HF tensors, the range of its axis `rows_axis` (of the per-layer tensor) this one
    fills; offset: the HF index of our stack's first layer (the MoE layers after DeepSeek-V3's
    dense first ones)."""

    hf: str
    ours: str
    factors: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    rows: tuple[int, int] | None = None
    rows_axis: int = 0
    offset: int = 0

    def name(self, layer: int | None) -> str:
        return self.hf.format(l=None if layer is None else layer + self.offset)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(f) for f in self.factors)


def layered(ours: str) -> bool:
    return "_L" in ours


def pieces(c: TransformerConfig, vocab: int, positions: int, prefix: str = "") -> list[Piece]:
    """Every HF tensor of config `c` (HF vocabulary `vocab`, `positions` learned positions)."""
    if c.style == "llama" and c.dense_layers:
        return _stacked_pieces(c, vocab) + _mtp_pieces(c, vocab)
    if c.style == "llama":
        mlp = _moe_pieces(c) if c.num_experts else _mlp_pieces(c)
        return _llama_pieces(c, vocab) + mlp + _mtp_pieces(c, vocab)
    _no_gpt2_moe(c)
    return _gpt2_pieces(c, vocab, positions, prefix)


def _stacked_pieces(c: TransformerConfig, vocab: int) -> list[Piece]:
    """A model of dense first layers and MoE layers (DeepSeek-V3): each stack's layer pieces,
    ours prefixed as the stack's weights are, HF's numbered from the stack's first layer; the
    embedding, final norm and head once."""
    out, first = [], 0
    for prefix, stack in stacks(c):
        mlp = _moe_pieces(stack) if stack.num_experts else _mlp_pieces(stack)
        for p in _llama_pieces(stack, vocab) + mlp:
            if layered(p.ours):
                out.append(p._replace(ours=prefix + p.ours, offset=first))
            elif prefix != DENSE:
                out.append(p)
        first += stack.num_layers
    return out


def _mtp_in_hf(c: TransformerConfig) -> bool:
    """Whether the model's prediction modules have a Hugging Face form (DeepSeek-V3's: MLA)."""
    return bool(c.mtp_depth and c.mla)


def _mtp_pieces(c: TransformerConfig, vocab: int) -> list[Piece]:
    """DeepSeek-V3's multi-token prediction modules (mtp_depth), as its checkpoints hold them:
    module k as layer num_layers + k, its block's weights under the layer's usual names, beside
    enorm, hnorm, eh_proj ([D, 2 D]: the embedding's half first) and shared_head.norm. Other
    architectures have no place for them in their Hugging Face form, where inference drops
    them anyway: none."""
    if not _mtp_in_hf(c):
        return []
    block, L, D = mtp_block(c), c.num_layers, c.d_model
    mlp = _moe_pieces(block) if block.num_experts else _mlp_pieces(block)
    out = [
        p._replace(ours=MTP + p.ours, offset=L)
        for p in _llama_pieces(block, vocab) + mlp
        if layered(p.ours)
    ]
    layer = "model.layers.{l}."
    own = (("enorm", "enorm_scale_LD"), ("hnorm", "hnorm_scale_LD"))
    own += (("shared_head.norm", "head_norm_scale_LD"),)
    out += [Piece(f"{layer}{x}.weight", MTP + ours, ((D,),), (0,), offset=L) for x, ours in own]
    eh = Piece(layer + "eh_proj.weight", MTP + "eh_proj_LID", ((D,), (2 * D,)), (1, 0), offset=L)
    return [*out, eh]


def _mtp_copies(c: TransformerConfig, vocab: int) -> list[Piece]:
    """The copies of the shared embedding and head DeepSeek-V3's checkpoints keep in each
    prediction module (embed_tokens, shared_head.head): written on export, so the checkpoint
    has its usual form; never read (the model's own are)."""
    if not _mtp_in_hf(c):
        return []
    D, out = c.d_model, []
    for layer in range(c.num_layers, c.num_layers + c.mtp_depth):
        embed = f"model.layers.{layer}.embed_tokens.weight"
        out.append(Piece(embed, "tok_embed_VD", ((vocab,), (D,)), (0, 1)))
        head = f"model.layers.{layer}.shared_head.head.weight"
        tied = ("tok_embed_VD", (0, 1)) if c.tie_embeddings else ("head_DV", (1, 0))
        out.append(Piece(head, tied[0], ((vocab,), (D,)), tied[1]))
    return out


def _no_gpt2_moe(c: TransformerConfig) -> None:
    if c.num_experts:
        raise ConfigError("GPT-2 style mixture-of-experts models have no Hugging Face form")


def _llama_pieces(c: TransformerConfig, vocab: int) -> list[Piece]:
    """Embedding, norms, attention and head: Llama's names, which Mistral, Mixtral, Qwen2 and
    Qwen3 (its q_norm and k_norm added) share."""
    D, N, G, H = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    QG = N // G
    layer = "model.layers.{l}."
    out = [
        Piece("model.embed_tokens.weight", "tok_embed_VD", ((vocab,), (D,)), (0, 1)),
        Piece("model.norm.weight", "norm_f_scale_D", ((D,),), (0,)),
        Piece(layer + "input_layernorm.weight", "norm1_scale_LD", ((D,),), (0,)),
        Piece(layer + "post_attention_layernorm.weight", "norm2_scale_LD", ((D,),), (0,)),
        Piece(layer + "self_attn.o_proj.weight", "wo_LNHD", ((D,), (N, H)), (1, 2, 0)),
    ]
    if not c.tie_embeddings:
        out.append(Piece("lm_head.weight", "head_DV", ((vocab,), (D,)), (1, 0)))
    if c.mla:
        return out + _mla_pieces(c)
    rows = {"q": ((G, QG, H), (0, QG)), "k": ((G, 1, H), (QG, QG + 1))}
    rows["v"] = ((G, 1, H), (QG + 1, QG + 2))
    for x, (heads, qkv) in rows.items():
        proj = f"{layer}self_attn.{x}_proj."
        out.append(Piece(proj + "weight", "wqkv_LDGQH", (heads, (D,)), (3, 0, 1, 2), qkv, 2))
        if c.attention_bias:
            out.append(Piece(proj + "bias", "bias_qkv_LGQH", (heads,), (0, 1, 2), qkv, 1))
    if c.out_bias:
        out.append(Piece(layer + "self_attn.o_proj.bias", "bias_o_LD", ((D,),), (0,)))
    if c.qk_norm:
        for x in ("q", "k"):
            norm = f"{layer}self_attn.{x}_norm.weight"
            out.append(Piece(norm, f"{x}_norm_scale_LH", ((H,),), (0,)))
    return out


def _mla_pieces(c: TransformerConfig) -> list[Piece]:
    """DeepSeek-V3's latent attention (models/mla.py's legend): each HF linear is [out, in],
    the heads' outputs flattened (n, u); the kv down-projection keeps the latent and the RoPE
    key side by side (A = C + P), as ours does."""
    D, N, C, R = c.d_model, c.num_heads, c.kv_lora_rank, c.q_lora_rank
    U, X, A = c.qk_head_dim, c.qk_nope_head_dim + c.v_head_dim, C + c.qk_rope_head_dim
    attn = "model.layers.{l}.self_attn."
    out = [
        Piece(attn + "kv_a_proj_with_mqa.weight", "wkv_a_LDA", ((A,), (D,)), (1, 0)),
        Piece(attn + "kv_a_layernorm.weight", "kv_a_norm_scale_LC", ((C,),), (0,)),
        Piece(attn + "kv_b_proj.weight", "wkv_b_LCNX", ((N, X), (C,)), (2, 0, 1)),
    ]
    if not R:
        return [Piece(attn + "q_proj.weight", "wq_LDNU", ((N, U), (D,)), (2, 0, 1)), *out]
    return [
        Piece(attn + "q_a_proj.weight", "wq_a_LDR", ((R,), (D,)), (1, 0)),
        Piece(attn + "q_a_layernorm.weight", "q_a_norm_scale_LR", ((R,),), (0,)),
        Piece(attn + "q_b_proj.weight", "wq_b_LRNU", ((N, U), (R,)), (2, 0, 1)),
        *out,
    ]


def _mlp_pieces(c: TransformerConfig) -> list[Piece]:
    D, F = c.d_model, c.d_mlp
    mlp = "model.layers.{l}.mlp."
    out = [
        Piece(mlp + "gate_proj.weight", "w_gate_LDF", ((F,), (D,)), (1, 0)),
        Piece(mlp + "up_proj.weight", "w_up_LDF", ((F,), (D,)), (1, 0)),
        Piece(mlp + "down_proj.weight", "w_down_LFD", ((D,), (F,)), (1, 0)),
    ]
    if c.mlp_bias:
        for x, ours, n in (("gate", "bias_gate_LF", F), ("up", "bias_up_LF", F)):
            out.append(Piece(f"{mlp}{x}_proj.bias", ours, ((n,),), (0,)))
        out.append(Piece(mlp + "down_proj.bias", "bias_down_LD", ((D,),), (0,)))
    return out


def moe_architecture(c: TransformerConfig) -> str:
    """The HF form of a MoE config: DeepSeek-V3 (latent attention), Qwen2-MoE (its gated
    shared expert), Qwen3-MoE (its per-head q/k norms) or Mixtral."""
    if c.mla:
        return _deepseek_form(c)
    if c.dense_layers:
        raise ConfigError(
            "dense first layers (dense_layers) without latent attention have no Hugging Face "
            "form here (DeepSeek-V3's first_k_dense_replace comes with MLA)"
        )
    if c.scoring != "softmax" or c.n_group > 1 or c.router_bias or c.routed_scaling_factor != 1:
        raise ConfigError(
            "a router with sigmoid scores, groups, a selection bias or a scaling factor "
            "(DeepSeek-V3's) has no Hugging Face form here yet: it comes with MLA attention"
        )
    if c.shared_expert_gate:
        return "Qwen2MoeForCausalLM"
    if c.shared_width:
        raise ConfigError(
            "a shared expert without a gate (DeepSeek's n_shared_experts) has no Hugging Face "
            "form here yet: it comes with MLA attention"
        )
    if c.qk_norm:
        return "Qwen3MoeForCausalLM"
    if not c.moe_renormalize:
        raise ConfigError(
            "a mixture of experts without renormalized top-k weights and without q/k norms "
            "has no Hugging Face form here (Mixtral renormalizes; Qwen3-MoE has q/k norms)"
        )
    return "MixtralForCausalLM"


def _deepseek_form(c: TransformerConfig) -> str:
    """DeepSeek-V3's MoE layer: a sigmoid router with its selection bias (exported as zeros
    where ours has none), shared experts of n_shared_experts x d_mlp, ungated."""
    if c.scoring != "sigmoid" or c.shared_expert_gate or c.shared_expert_intermediate_size:
        raise ConfigError(
            "a latent-attention MoE exports as DeepSeek-V3, whose router scores by sigmoid and "
            "whose shared experts are n_shared_experts x d_mlp wide, ungated; this model's "
            f"scoring is {c.scoring}, shared_expert_gate {c.shared_expert_gate}, "
            f"shared_expert_intermediate_size {c.shared_expert_intermediate_size}"
        )
    return "DeepseekV3ForCausalLM"


def _moe_pieces(c: TransformerConfig) -> list[Piece]:
    """The router and one tensor per expert: Mixtral's block_sparse_moe (w1 gate, w3 up, w2
    down) or Qwen3-MoE's and DeepSeek-V3's mlp (gate_proj, up_proj, down_proj)."""
    D, F, E = c.d_model, c.d_mlp, c.num_experts
    arch = moe_architecture(c)
    if arch == "MixtralForCausalLM":
        block, names = "model.layers.{l}.block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, names = "model.layers.{l}.mlp.", ("gate_proj", "up_proj", "down_proj")
    out = [Piece(block + "gate.weight", "router_LDE", ((E,), (D,)), (1, 0))]
    if arch == "DeepseekV3ForCausalLM":
        out += deepseek_router_pieces(c)
    else:
        out += shared_expert_pieces(c, block)
    for e in range(E):
        expert = f"{block}experts.{e}."
        # Each is [out, in]: our [E, in, out] rows e..e+1 (a size-1 factor for the E axis).
        gate, up, down = (f"{expert}{n}.weight" for n in names)
        out.append(Piece(gate, "w_gate_LEDF", ((1, F), (D,)), (0, 2, 1), (e, e + 1), 0))
        out.append(Piece(up, "w_up_LEDF", ((1, F), (D,)), (0, 2, 1), (e, e + 1), 0))
        out.append(Piece(down, "w_down_LEFD", ((1, D), (F,)), (0, 2, 1), (e, e + 1), 0))
    return out


def shared_expert_pieces(c: TransformerConfig, block: str) -> list[Piece]:
    """The shared expert's SwiGLU and its gate: Qwen2-MoE's mlp.shared_expert and
    shared_expert_gate (a [1, D] linear); DeepSeek-V3's mlp.shared_experts (no gate)."""
    if not c.shared_width:
        return []
    D, S = c.d_model, c.shared_width
    mlp = block + ("shared_expert." if c.shared_expert_gate else "shared_experts.")
    out = [
        Piece(mlp + "gate_proj.weight", "shared_w_gate_LDF", ((S,), (D,)), (1, 0)),
        Piece(mlp + "up_proj.weight", "shared_w_up_LDF", ((S,), (D,)), (1, 0)),
        Piece(mlp + "down_proj.weight", "shared_w_down_LFD", ((D,), (S,)), (1, 0)),
    ]
    if c.shared_expert_gate:
        out.append(
            Piece(block + "shared_expert_gate.weight", "shared_gate_LD1", ((1,), (D,)), (1, 0))
        )
    return out


def deepseek_router_pieces(c: TransformerConfig) -> list[Piece]:
    """DeepSeek-V3's MoE layer (HF's DeepseekV3MoE) beside the router and experts that
    _moe_pieces names with Qwen's block: the selection bias (mlp.gate.e_score_correction_bias)
    and the shared experts."""
    block = "model.layers.{l}.mlp."
    bias = Piece(
        block + "gate.e_score_correction_bias", "expert_bias_LE", ((c.num_experts,),), (0,)
    )
    return [bias, *shared_expert_pieces(c, block)]


def _gpt2_pieces(c: TransformerConfig, vocab: int, positions: int, prefix: str) -> list[Piece]:
    D, F, N, G, H = c.d_model, c.d_mlp, c.num_heads, c.num_kv_heads, c.head_dim
    if G != N:
        raise ConfigError(
            f"GPT-2 has one key/value head per query head; this model has {G} kv heads for "
            f"{N} heads, so it has no GPT2LMHeadModel form (a llama-style model exports as Llama)"
        )
    p, layer = prefix, prefix + "h.{l}."
    out = [
        Piece(p + "wte.weight", "tok_embed_VD", ((vocab,), (D,)), (0, 1)),
        Piece(p + "wpe.weight", "pos_embed_TD", ((positions,), (D,)), (0, 1)),
        Piece(p + "ln_f.weight", "norm_f_scale_D", ((D,),), (0,)),
        Piece(p + "ln_f.bias", "norm_f_bias_D", ((D,),), (0,)),
        Piece(layer + "attn.c_attn.weight", "wqkv_LDGQH", ((D,), (3, N, H)), (0, 2, 1, 3)),
        Piece(layer + "attn.c_attn.bias", "bias_qkv_LGQH", ((3, N, H),), (1, 0, 2)),
        Piece(layer + "attn.c_proj.weight", "wo_LNHD", ((N, H), (D,)), (0, 1, 2)),
        Piece(layer + "attn.c_proj.bias", "bias_o_LD", ((D,),), (0,)),
        Piece(layer + "mlp.c_fc.weight", "w_up_LDF", ((D,), (F,)), (0, 1)),
        Piece(layer + "mlp.c_fc.bias", "bias_up_LF", ((F,),), (0,)),
        Piece(layer + "mlp.c_proj.weight", "w_down_LFD", ((F,), (D,)), (0, 1)),
        Piece(layer + "mlp.c_proj.bias", "bias_down_LD", ((D,),), (0,)),
    ]
    for x in ("1", "2"):
        out.append(Piece(f"{layer}ln_{x}.weight", f"norm{x}_scale_LD", ((D,),), (0,)))
        out.append(Piece(f"{layer}ln_{x}.bias", f"norm{x}_bias_LD", ((D,),), (0,)))
    if not c.tie_embeddings:
        out.append(Piece("lm_head.weight", "head_DV", ((vocab,), (D,)), (1, 0)))
    return out


def export_pieces(c: TransformerConfig, vocab: int) -> tuple[list[Piece], TransformerConfig]:
    """The HF tensors to write, with their sources; GPT-2 always has biases (zeros where our
    model has none)."""
    if c.style == "gpt2":
        _no_gpt2_moe(c)
        c = dataclasses.replace(c, attention_bias=True, attention_out_bias=None, mlp_bias=True)
    out = pieces(c, vocab, c.seq_len, "transformer." if c.style == "gpt2" else "")
    return out + _mtp_copies(c, vocab), c


def hf_tensor(piece: Piece, ours_layer: np.ndarray | None) -> np.ndarray:
    """The HF tensor (one layer's) from our gathered per-layer tensor; zeros where we have none."""
    if ours_layer is None:
        return np.zeros(piece.hf_shape, np.float32)
    x = ours_layer
    if piece.rows is not None:
        x = np.take(x, np.arange(*piece.rows), axis=piece.rows_axis)
    sizes = [f for dim in piece.factors for f in dim]
    x = x[tuple(slice(0, sizes[f]) for f in piece.perm)]  # the padded vocabulary cut off
    return np.transpose(x, np.argsort(piece.perm)).reshape(piece.hf_shape)
