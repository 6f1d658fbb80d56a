"""Hugging Face models in and out: LlamaForCausalLM and GPT2LMHeadModel as TransformerConfigs,
and the map between their tensors and the stacked, fused parameters of models/transformer.py.

Legend: as models/transformer.py (L layers, D embed, F mlp, N heads, G kv groups, QG query heads
per group, H head_dim, V vocab, P positions).

Every Hugging Face tensor is one of ours (one layer of it, for layer weights) under a reshape
and a transpose: its dims, each split into factors, are our dims in another order (`Piece`).
That one description serves both ways: import reads the block of each HF tensor that a device's
shard needs (whole heads, a range of rows or columns) and transposes it into place; export
transposes a gathered tensor back. The fused QKV weight is three pieces (Llama's q, k and v
projections fill rows of our per-group qkv axis) or one (GPT-2's c_attn already is [q|k|v]).
Our vocabulary is padded to a multiple of 128: padded rows load as zeros and are cut on export.
"""

import dataclasses
import json
import math
import pathlib
from typing import NamedTuple

import numpy as np

from jaxdist.data import padded_vocab
from jaxdist.errors import ConfigError
from models.transformer import TransformerConfig, _param_shapes

# Each architecture by our style, and the config.json keys of the sizes it maps one to one.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
_SIZE_KEYS = {
    "LlamaForCausalLM": dict(
        d_model="hidden_size",
        num_layers="num_hidden_layers",
        num_heads="num_attention_heads",
        seq_len="max_position_embeddings",
    ),
    "GPT2LMHeadModel": dict(
        d_model="n_embd", num_layers="n_layer", num_heads="n_head", seq_len="n_positions"
    ),
}
SUPPORTED = tuple(_ARCHITECTURES.values())
# Non-weights that some saved checkpoints carry: attention-mask and RoPE buffers.
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


class Piece(NamedTuple):
    """One HF tensor (`{l}` in the name: one per layer) as one of our parameters (per layer).

    factors: each HF dim split into factors (row-major); perm: our dims, each given as the
    index of its factor among all factors in order; qkv: for the fused QKV, the rows of our
    qkv axis (axis `qkv_axis` of the per-layer tensor) this tensor fills."""

    hf: str
    ours: str
    factors: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    qkv: tuple[int, int] | None = None
    qkv_axis: int = 0

    def name(self, layer: int | None) -> str:
        return self.hf.format(l=layer)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(f) for f in self.factors)


class HFModel(NamedTuple):
    """A local Hugging Face model directory, read: its config.json as ours and what export
    and generation need to give it back."""

    path: pathlib.Path
    hf_config: dict
    architecture: str
    config: TransformerConfig
    vocab_size: int  # the model's own, before padding
    prefix: str  # GPT-2 checkpoints come with "transformer." or without

    def record(self) -> dict:
        return {
            "path": str(self.path.absolute()),
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "config": self.hf_config,
        }


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


def _rope_theta(hf: dict, where: str) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConfigError(
            f"{where}: RoPE scaling {kind!r} is not supported (only the plain rotary embedding)"
        )
    return float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def config_from_hf(hf: dict, name: str, where: str) -> tuple[TransformerConfig, int]:
    """Our config for a HF config.json (vocabulary padded), and the HF vocabulary size."""
    arch = architecture(hf, where)
    try:
        if arch == "LlamaForCausalLM":
            act = hf.get("hidden_act", "silu")
            D, N = hf["hidden_size"], hf["num_attention_heads"]
            if act != "silu":
                raise ConfigError(f"{where}: activation {act!r}; Llama here uses silu (SwiGLU)")
            if hf.get("head_dim", D // N) != D // N:
                raise ConfigError(
                    f"{where}: head_dim {hf['head_dim']} is not hidden_size / heads ({D // N})"
                )
            fields = dict(
                style="llama",
                num_kv_heads=hf.get("num_key_value_heads") or N,
                d_mlp=hf["intermediate_size"],
                rope_theta=_rope_theta(hf, where),
                norm_eps=hf.get("rms_norm_eps", 1e-6),
                attention_bias=bool(hf.get("attention_bias", False)),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            )
        else:
            act = hf.get("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh"):
                raise ConfigError(f"{where}: activation {act!r}; GPT-2 here uses gelu_new")
            for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
                if hf.get(flag):
                    raise ConfigError(f"{where}: {flag} is not supported")
            fields = dict(
                style="gpt2",
                num_kv_heads=hf["n_head"],
                d_mlp=hf.get("n_inner") or 4 * hf["n_embd"],
                norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                attention_bias=True,
                mlp_bias=True,
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            )
        fields |= {ours: hf[key] for ours, key in _SIZE_KEYS[arch].items()}
        vocab = hf["vocab_size"]
        return TransformerConfig(name=name, vocab_size=padded_vocab(vocab), **fields), vocab
    except KeyError as e:
        raise ConfigError(f"{where}: config.json lacks {e.args[0]!r}") from None
    except ValueError as e:  # the config's own checks
        raise ConfigError(f"{where}: {e}") from None


def open_model(spec: str) -> HFModel:
    """`hf:PATH` (or PATH): the model directory's config, read and checked (no weights yet)."""
    path = pathlib.Path(spec.removeprefix("hf:"))
    hf = read_config(path)
    config, vocab = config_from_hf(hf, f"hf:{path.name}", str(path))
    prefix = ""
    if config.style == "gpt2":
        from jaxdist.hf.safetensors_io import SafetensorsDir

        names = SafetensorsDir(path).tensors
        prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
    return HFModel(path, hf, architecture(hf, str(path)), config, vocab, prefix)


def pieces(c: TransformerConfig, vocab: int, positions: int, prefix: str = "") -> list[Piece]:
    """Every HF tensor of config `c` (HF vocabulary `vocab`, `positions` learned positions)."""
    D, F, N, G, H = c.d_model, c.d_mlp, c.num_heads, c.num_kv_heads, c.head_dim
    QG = N // G
    if c.num_experts:
        raise ConfigError("mixture-of-experts models have no Hugging Face mapping here")
    if c.style == "llama":
        layer = "model.layers.{l}."
        out = [
            Piece("model.embed_tokens.weight", "tok_embed_VD", ((vocab,), (D,)), (0, 1)),
            Piece("model.norm.weight", "norm_f_scale_D", ((D,),), (0,)),
            Piece(layer + "input_layernorm.weight", "norm1_scale_LD", ((D,),), (0,)),
            Piece(layer + "post_attention_layernorm.weight", "norm2_scale_LD", ((D,),), (0,)),
            Piece(layer + "self_attn.o_proj.weight", "wo_LNHD", ((D,), (N, H)), (1, 2, 0)),
            Piece(layer + "mlp.gate_proj.weight", "w_gate_LDF", ((F,), (D,)), (1, 0)),
            Piece(layer + "mlp.up_proj.weight", "w_up_LDF", ((F,), (D,)), (1, 0)),
            Piece(layer + "mlp.down_proj.weight", "w_down_LFD", ((D,), (F,)), (1, 0)),
        ]
        if not c.tie_embeddings:
            out.append(Piece("lm_head.weight", "head_DV", ((vocab,), (D,)), (1, 0)))
        rows = {"q": ((G, QG, H), (0, QG)), "k": ((G, 1, H), (QG, QG + 1))}
        rows["v"] = ((G, 1, H), (QG + 1, QG + 2))
        for x, (heads, qkv) in rows.items():
            proj = f"{layer}self_attn.{x}_proj."
            out.append(Piece(proj + "weight", "wqkv_LDGQH", (heads, (D,)), (3, 0, 1, 2), qkv, 2))
            if c.attention_bias:
                out.append(Piece(proj + "bias", "bias_qkv_LGQH", (heads,), (0, 1, 2), qkv, 1))
        if c.attention_bias:
            out.append(Piece(layer + "self_attn.o_proj.bias", "bias_o_LD", ((D,),), (0,)))
        if c.mlp_bias:
            for x, ours, n in (("gate", "bias_gate_LF", F), ("up", "bias_up_LF", F)):
                out.append(Piece(f"{layer}mlp.{x}_proj.bias", ours, ((n,),), (0,)))
            out.append(Piece(layer + "mlp.down_proj.bias", "bias_down_LD", ((D,),), (0,)))
        return out
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


def layered(ours: str) -> bool:
    return "_L" in ours


def check_weights(model: HFModel, tensors: dict) -> list[Piece]:
    """Every tensor the config implies is there with its shape, and nothing unknown is; the
    pieces to load. `tensors`: name -> TensorInfo (jaxdist.hf.safetensors_io)."""
    c = model.config
    positions = model.hf_config.get("n_positions", c.seq_len)
    plan = pieces(c, model.vocab_size, positions, model.prefix)
    expected = {}
    for piece in plan:
        for layer in range(c.num_layers) if layered(piece.ours) else [None]:
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
    extra = [n for n in tensors if n not in expected and not n.endswith(ignorable)]
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
            if piece.qkv is None:
                return read_block(reader, piece.name(layer), piece, index)
            q = index[piece.qkv_axis]
            lo, hi = max(q.start, piece.qkv[0]), min(q.stop, piece.qkv[1])
            if lo < hi:
                sub = list(index)
                sub[piece.qkv_axis] = slice(lo - piece.qkv[0], hi - piece.qkv[0])
                parts.append(read_block(reader, piece.name(layer), piece, tuple(sub)))
        return np.concatenate(parts, axis=by_name[ours][0].qkv_axis)

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


# --- export --------------------------------------------------------------------------------


def export_config(
    c: TransformerConfig, vocab: int, base: dict | None, dtype: str, eos_id: int | None
) -> dict:
    """config.json for our model: the source's own with sizes refreshed, if it came from one;
    else EOS as BOS too (jaxdist's token data opens every document with EOS)."""
    arch = _ARCHITECTURES[c.style]
    hf = {"architectures": [arch], "model_type": c.style}
    hf |= {key: getattr(c, ours) for ours, key in _SIZE_KEYS[arch].items()}
    if c.style == "llama":
        hf |= dict(
            intermediate_size=c.d_mlp,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
            hidden_act="silu",
            attention_bias=c.attention_bias,
            mlp_bias=c.mlp_bias,
        )
    else:
        hf |= dict(n_inner=c.d_mlp, layer_norm_epsilon=c.norm_eps, activation_function="gelu_new")
    hf |= {"vocab_size": vocab, "tie_word_embeddings": c.tie_embeddings, "dtype": dtype}
    if base and base.get("architectures") == hf["architectures"]:
        if "rope_theta" in base:  # written by transformers before rope_parameters
            hf["rope_theta"] = c.rope_theta
        return {**base, **hf}
    return {**hf, "bos_token_id": eos_id, "eos_token_id": eos_id}


def export_pieces(c: TransformerConfig, vocab: int) -> tuple[list[Piece], TransformerConfig]:
    """The HF tensors to write, with their sources; GPT-2 always has biases (zeros where our
    model has none)."""
    if c.style == "gpt2":
        c = dataclasses.replace(c, attention_bias=True, mlp_bias=True)
    return pieces(c, vocab, c.seq_len, "transformer." if c.style == "gpt2" else ""), c


def hf_tensor(piece: Piece, ours_layer: np.ndarray | None) -> np.ndarray:
    """The HF tensor (one layer's) from our gathered per-layer tensor; zeros where we have none."""
    if ours_layer is None:
        return np.zeros(piece.hf_shape, np.float32)
    x = ours_layer
    if piece.qkv is not None:
        x = np.take(x, np.arange(*piece.qkv), axis=piece.qkv_axis)
    sizes = [f for dim in piece.factors for f in dim]
    x = x[tuple(slice(0, sizes[f]) for f in piece.perm)]  # the padded vocabulary cut off
    return np.transpose(x, np.argsort(piece.perm)).reshape(piece.hf_shape)
