"""Hugging Face config.json files as TransformerConfigs and back: one reader per architecture.

Supported: LlamaForCausalLM (Llama 1-3.x: RoPE scaling llama3, linear, dynamic, yarn),
MistralForCausalLM (a sliding window only where it covers the context), Qwen2ForCausalLM (Q, K
and V biases, no output bias), Qwen3ForCausalLM (per-head q/k RMSNorm, head_dim apart from
hidden_size / heads), MixtralForCausalLM, Qwen3MoeForCausalLM and Qwen2MoeForCausalLM (every
layer a top-k MoE; Qwen2-MoE's with its gated shared expert), DeepseekV3ForCausalLM (latent
attention; its first_k_dense_replace layers dense, the rest MoE with DeepSeek's routing; the
multi-token prediction modules past num_hidden_layers as mtp_depth, as far as the weights hold
them: checkpoint_mtp), GPT2LMHeadModel. Anything else is
refused in one line naming what is.
"""

import dataclasses
import functools
import json
import logging
import pathlib

from jaxdist.data import padded_vocab
from jaxdist.errors import ConfigError
from models import rope
from models.hf_pieces import moe_architecture
from models.transformer_config import TransformerConfig

SUPPORTED = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "GPT2LMHeadModel",
)
_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "GPT2LMHeadModel": "gpt2",
}
_GPT2_SIZES = dict(d_model="n_embd", num_layers="n_layer", num_heads="n_head")


def read_config(path: str | pathlib.Path) -> dict:
    config = pathlib.Path(path) / "config.json"
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{config} is missing or unreadable ({e}); pass a local Hugging Face model directory "
            "(config.json, model.safetensors, tokenizer.json)"
        ) from None


def architecture(hf: dict, where: str) -> str:
    archs = hf.get("architectures") or [hf.get("model_type", "unknown")]
    if archs[0] not in SUPPORTED:
        raise ConfigError(
            f"{where}: architecture {archs[0]!r} is not supported; supported: "
            f"{', '.join(SUPPORTED)}"
        )
    return archs[0]


def config_from_hf(hf: dict, name: str, where: str) -> tuple[TransformerConfig, int]:
    """Our config for a HF config.json (vocabulary padded), and the HF vocabulary size."""
    arch = architecture(hf, where)
    try:
        fields = _gpt2(hf, where) if arch == "GPT2LMHeadModel" else _llama_family(hf, where, arch)
        vocab = hf["vocab_size"]
        return TransformerConfig(name=name, vocab_size=padded_vocab(vocab), **fields), vocab
    except KeyError as e:
        raise ConfigError(f"{where}: config.json lacks {e.args[0]!r}") from None
    except ValueError as e:  # the config's own checks
        raise ConfigError(f"{where}: {e}") from None


def _gpt2(hf: dict, where: str) -> dict:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"{where}: activation {act!r}; GPT-2 here uses gelu_new")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise ConfigError(f"{where}: {flag} is not supported")
    return dict(
        style="gpt2",
        num_kv_heads=hf["n_head"],
        d_mlp=hf.get("n_inner") or 4 * hf["n_embd"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        attention_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        seq_len=hf["n_positions"],
        **{ours: hf[key] for ours, key in _GPT2_SIZES.items()},
    )


def _llama_family(hf: dict, where: str, arch: str) -> dict:
    """Llama and the architectures built on its layout (RMSNorm, SwiGLU, RoPE)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: activation {act!r}; {arch} here uses silu (SwiGLU)")
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    H = hf.get("head_dim") or D // N
    theta, scaling = rope.from_hf(hf, where)
    fields = dict(
        style="llama",
        d_model=D,
        num_layers=hf["num_hidden_layers"],
        num_heads=N,
        num_kv_heads=hf.get("num_key_value_heads") or N,
        d_mlp=hf["intermediate_size"],
        head_dim_override=H if H * N != D else 0,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    bias = bool(hf.get("attention_bias", False))
    if arch == "LlamaForCausalLM":
        fields |= dict(attention_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))
    elif arch == "Qwen2ForCausalLM":
        fields |= dict(attention_bias=True, attention_out_bias=False)
    elif arch == "Qwen2MoeForCausalLM":
        fields |= dict(attention_bias=bool(hf.get("qkv_bias", True)), attention_out_bias=False)
    elif arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        fields |= dict(attention_bias=bias, qk_norm=True)
    if arch in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        fields |= _moe(hf, where, arch)
    if arch == "DeepseekV3ForCausalLM":
        fields |= _deepseek(hf, where)
    window = _sliding_window(hf, arch)
    context = hf["max_position_embeddings"]
    if window and window < context:
        # Full attention equals the model's up to the window: the longest context offered.
        context, fields["sliding_window"] = window, window
    return fields | {"seq_len": context}


def _moe(hf: dict, where: str, arch: str) -> dict:
    if arch == "MixtralForCausalLM":
        return dict(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"])
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError(
            f"{where}: {arch} with dense layers among the MoE ones (decoder_sparse_step "
            f"{hf.get('decoder_sparse_step', 1)}, mlp_only_layers {hf.get('mlp_only_layers')}) "
            "is not supported; every layer must be MoE (decoder_sparse_step 1, no mlp_only_layers)"
        )
    experts = hf.get("num_experts") or hf["num_local_experts"]
    fields = dict(
        num_experts=experts,
        top_k=hf["num_experts_per_tok"],
        d_mlp=hf["moe_intermediate_size"],
        moe_renormalize=bool(hf.get("norm_topk_prob", False)),
    )
    if arch == "Qwen2MoeForCausalLM":
        shared = hf["shared_expert_intermediate_size"]
        fields |= dict(shared_expert_intermediate_size=shared, shared_expert_gate=True)
    return fields


def deepseek_moe(hf: dict, where: str) -> dict:
    """The MoE half of a DeepSeek-V3 config.json (HF's DeepseekV3Config) as our fields: sigmoid
    scores, groups, the selection bias, the shared experts, the dense first layers."""
    dense = hf.get("first_k_dense_replace") or 0
    return dict(
        dense_layers=dense,
        dense_d_mlp=hf["intermediate_size"] if dense else 0,
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        d_mlp=hf["moe_intermediate_size"],
        moe_renormalize=bool(hf.get("norm_topk_prob", True)),
        scoring="sigmoid",
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        router_bias=True,
        n_shared_experts=hf.get("n_shared_experts") or 0,
    )


# DeepSeek-V3's latent attention fields, as config.json names them and TransformerConfig does.
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _deepseek(hf: dict, where: str) -> dict:
    """Latent attention (models/mla.py): one key and value per query head whatever
    num_key_value_heads says (transformers' kv_b_proj gives one per head), no head_dim of its
    own (config.json's is the RoPE part's)."""
    dense, L = hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]
    if dense < 0:
        raise ConfigError(f"{where}: first_k_dense_replace {dense} must be >= 0")
    if hf.get("attention_bias"):
        raise ConfigError(f"{where}: DeepSeek-V3 attention biases are not supported")
    fields = {k: hf[k] or 0 for k in MLA_FIELDS}  # q_lora_rank None: a plain q projection
    fields |= dict(
        num_kv_heads=hf["num_attention_heads"],
        head_dim_override=0,
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )
    # The multi-token prediction modules, as many as the weights hold (checkpoint_mtp).
    fields["mtp_depth"] = hf.get("num_nextn_predict_layers") or 0
    # Every layer dense (first_k_dense_replace >= num_hidden_layers, as transformers reads it):
    # no experts at all.
    return fields | (deepseek_moe(hf, where) if dense < L else {})


def checkpoint_mtp(config: TransformerConfig, path: pathlib.Path, where: str) -> TransformerConfig:
    """`config` with as many multi-token prediction modules as the directory's weights hold
    (module k: model.layers.{num_layers + k - 1}.eh_proj.weight); a directory of config.json
    alone keeps what it says (the architecture, to plan or train from scratch).

    A checkpoint without them (transformers saves none: its DeepseekV3ForCausalLM drops them)
    loads without them, said in one line: fine-tuning it then trains the model transformers
    runs. Fresh modules instead would add a random block's loss to the objective, whose
    gradients move the pretrained trunk, embedding and head from the first step."""
    from jaxdist.hf.safetensors_io import INDEX, SINGLE, SafetensorsDir

    path = pathlib.Path(path)
    if not config.mtp_depth or not ((path / INDEX).is_file() or (path / SINGLE).is_file()):
        return config
    names = SafetensorsDir(path).tensors
    held = 0
    while (
        held < config.mtp_depth
        and f"model.layers.{config.num_layers + held}.eh_proj.weight" in names
    ):
        held += 1
    if held < config.mtp_depth:
        _say_once(
            f"{where}: config.json has num_nextn_predict_layers {config.mtp_depth}, its weights "
            f"{held} multi-token prediction modules (model.layers.{config.num_layers}.eh_proj."
            f"weight and on); loaded with mtp_depth {held}"
        )
    return dataclasses.replace(config, mtp_depth=held)


@functools.cache
def _say_once(line: str) -> None:
    # The config is read more than once a command (the model's config, then its weights).
    logging.getLogger("jaxdist.hf").warning(line)


def _sliding_window(hf: dict, arch: str) -> int:
    """The window of sliding-window attention where the config turns it on; 0: none."""
    window = hf.get("sliding_window")
    if not window:
        return 0
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return window
    sliding_layers = "sliding_attention" in (hf.get("layer_types") or [])
    return window if hf.get("use_sliding_window") or sliding_layers else 0


def hf_architecture(c: TransformerConfig, base: str | None = None) -> str:
    """The HF architecture config `c` exports as: `base` (the source's) where it has this
    config's tensors and options, else the one that does."""
    if c.style == "gpt2":
        return "GPT2LMHeadModel"
    if c.mla:
        return "DeepseekV3ForCausalLM"
    if c.num_experts:
        return moe_architecture(c)
    if c.qk_norm:
        return "Qwen3ForCausalLM"
    if c.attention_bias and not c.out_bias and not c.mlp_bias:
        return "Qwen2ForCausalLM"
    plain = not (c.attention_bias or c.out_bias or c.mlp_bias)
    if c.sliding_window or (plain and base == "MistralForCausalLM"):
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def export_config(
    c: TransformerConfig, vocab: int, base: dict | None, dtype: str, eos_id: int | None
) -> dict:
    """config.json for our model: the source's own with sizes refreshed, if it came from one
    of the same architecture; else EOS as BOS too (jaxdist's token data opens every document
    with EOS)."""
    base_arch = (base or {}).get("architectures", [None])[0]
    arch = hf_architecture(c, base_arch)
    hf = {"architectures": [arch], "model_type": _MODEL_TYPE[arch]}
    if c.style == "gpt2":
        hf |= {key: getattr(c, ours) for ours, key in _GPT2_SIZES.items()}
        hf |= dict(n_positions=c.seq_len, n_inner=c.d_mlp, layer_norm_epsilon=c.norm_eps)
        hf["activation_function"] = "gelu_new"
    else:
        hf |= _llama_family_out(c, arch)
    hf |= {"vocab_size": vocab, "tie_word_embeddings": c.tie_embeddings, "dtype": dtype}
    if base and base_arch == arch:
        if "rope_theta" in base:  # written by transformers before rope_parameters
            hf["rope_theta"] = c.rope_theta
        if "rope_scaling" in base:
            hf["rope_scaling"] = dict(c.rope_scaling) or None
        return {**base, **hf}
    return {**hf, "bos_token_id": eos_id, "eos_token_id": eos_id}


def _llama_family_out(c: TransformerConfig, arch: str) -> dict:
    out = dict(
        hidden_size=c.d_model,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        max_position_embeddings=c.seq_len,
        intermediate_size=c.d_mlp,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.norm_eps,
        rope_parameters=rope.to_hf(c.rope_theta, c.rope_scaling),
        hidden_act="silu",
    )
    if arch == "LlamaForCausalLM":
        out |= dict(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        out["attention_bias"] = c.attention_bias
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        out["sliding_window"] = c.sliding_window or None
    if arch.startswith("Qwen"):
        out["use_sliding_window"] = False
    if arch == "DeepseekV3ForCausalLM":
        out |= {k: getattr(c, k) for k in MLA_FIELDS} | {"q_lora_rank": c.q_lora_rank or None}
        out |= dict(
            head_dim=c.qk_rope_head_dim,
            rope_interleave=c.rope_interleave,
            attention_bias=False,
            first_k_dense_replace=c.dense_layers if c.num_experts else c.num_layers,
            num_nextn_predict_layers=c.mtp_depth,
        )
        if c.num_experts:
            out |= _deepseek_moe_out(c)
    if arch == "MixtralForCausalLM":
        out |= dict(num_local_experts=c.num_experts, num_experts_per_tok=c.top_k)
    if arch == "Qwen2MoeForCausalLM":
        # Its intermediate_size is the dense MLP's of layers that are not MoE: none here.
        out |= dict(qkv_bias=c.attention_bias, intermediate_size=c.shared_width)
        out["shared_expert_intermediate_size"] = c.shared_width
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        out |= dict(
            num_experts=c.num_experts,
            num_experts_per_tok=c.top_k,
            moe_intermediate_size=c.d_mlp,
            norm_topk_prob=c.moe_renormalize,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out


def _deepseek_moe_out(c: TransformerConfig) -> dict:
    """deepseek_moe's fields back (its router's form checked by hf_pieces.moe_architecture)."""
    return dict(
        intermediate_size=c.dense_d_mlp or c.d_mlp,
        moe_intermediate_size=c.d_mlp,
        n_routed_experts=c.num_experts,
        num_experts_per_tok=c.top_k,
        n_shared_experts=c.n_shared_experts,
        n_group=c.n_group,
        topk_group=c.topk_group,
        routed_scaling_factor=c.routed_scaling_factor,
        norm_topk_prob=c.moe_renormalize,
    )
