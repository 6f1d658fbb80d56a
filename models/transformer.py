"""A decoder-only transformer family: GPT-2 style and Llama style variants of one code path.

Legend (dims carry logical axes, jaxdist.model.LOGICAL_AXES):
  B batch  T seq  D embed  F mlp  N heads  G kv_heads  Q qkv  H head_dim  V vocab  L layers
  S seq (key position, in attention masks)

Attention weights are fused per kv group, Megatron's GQA layout: wqkv is [D, G, N/G + 2, H]
(each group's query heads, then its key and its value head), so splitting G over devices keeps
every group whole, and the input gradient of Q, K and V is one partial sum, not three.

Options Hugging Face's checkpoints need (models/hf.py), off in the presets: biases on the
attention and MLP linear layers (bias_*; Qwen2's on Q, K and V only), a head tied to the token
embedding (no head_DV: the logits use tok_embed_VD transposed, so its gradient sums both uses),
RMSNorm of each query and key head before RoPE (Qwen3), a head width apart from D / N, and
scaled RoPE frequencies (models/rope.py). The configuration: models/transformer_config.py.

Layers are stored stacked along L and run with `lax.scan`, so compile time does not grow with
depth and every per-layer weight carries the `layers` logical axis. A MoE model whose first
layers are dense (dense_layers, DeepSeek-V3's first_k_dense_replace) has two stacks, each
scanned: the dense layers' weights named dense_... (dense_w_up_LDF), then the MoE layers' under
the usual names; a model of one kind keeps one stack and its names (transformer_config.stacks).

One layer's math is models/layer.py. The attention and dense MLP projections run through
jaxdist.kernels.fp8 (layer.project): in the compute dtype, or in FP8 where the step's --fp8
runs them so; with --fp8 delayed the model holds their scales and amax histories (Fp8Meta,
stacked over L like the weights; A: the history's length), which the step keeps apart from the
weights. The head, the embeddings, the
router, the norms, attention itself and MoE experts stay in the compute dtype.

Packed documents (jaxdist.kernels.documents): given `docs`, attention stays inside each document
(block-diagonal causal mask) and positions, learned or RoPE, restart at each document; without
them a row is one causal sequence at positions 0..T-1.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.errors import ConfigError
from jaxdist.kernels import fp8
from jaxdist.kernels.documents import Documents
from jaxdist.kernels.lookup import lookup
from jaxdist.model import Stages
from jaxdist.optim import ExpertBias
from jaxdist.parallel.attention import attention, document_mask
from jaxdist.rules import constrain, gathered
from models import moe, mtp, remat
from models.layer import PROJECTIONS, after_attention, norm, qkv
from models.mla import MLA_LOGICAL
from models.moe import MOE_LOGICAL
from models.transformer_config import (
    DENSE,
    EXPERT_WEIGHTS,
    MTP,
    TransformerConfig,
    _param_shapes,
    mtp_block,
    stacks,
)

LOGICAL = {
    "tok_embed_VD": ("vocab", "embed"),
    "head_DV": ("embed", "vocab"),
    "pos_embed_TD": ("seq", "embed"),
    "norm_f_scale_D": ("embed",),
    "norm_f_bias_D": ("embed",),
    "wqkv_LDGQH": ("layers", "embed", "kv_heads", "qkv", "head_dim"),
    "wo_LNHD": ("layers", "heads", "head_dim", "embed"),
    "norm1_scale_LD": ("layers", "embed"),
    "norm1_bias_LD": ("layers", "embed"),
    "norm2_scale_LD": ("layers", "embed"),
    "norm2_bias_LD": ("layers", "embed"),
    "w_up_LDF": ("layers", "embed", "mlp"),
    "w_gate_LDF": ("layers", "embed", "mlp"),
    "w_down_LFD": ("layers", "mlp", "embed"),
    "bias_qkv_LGQH": ("layers", "kv_heads", "qkv", "head_dim"),
    "bias_o_LD": ("layers", "embed"),
    "q_norm_scale_LH": ("layers", "head_dim"),
    "k_norm_scale_LH": ("layers", "head_dim"),
    "bias_up_LF": ("layers", "mlp"),
    "bias_gate_LF": ("layers", "mlp"),
    "bias_down_LD": ("layers", "embed"),
    **MOE_LOGICAL,
    **MLA_LOGICAL,
}
# The dense first layers' stack (dense_layers) and the multi-token prediction modules' blocks
# (mtp_depth): each weight laid out as its namesake in the main stack.
LOGICAL |= {pre + k: v for k, v in LOGICAL.items() if "_L" in k for pre in (DENSE, MTP)}
# The prediction modules' own (transformer_config.mtp_shapes): the projection's input, the two
# normed halves side by side, is not `embed` (one mesh axis may not split two dims of one).
LOGICAL |= {
    MTP + "enorm_scale_LD": ("layers", "embed"),
    MTP + "hnorm_scale_LD": ("layers", "embed"),
    MTP + "eh_proj_LID": ("layers", None, "embed"),
    MTP + "head_norm_scale_LD": ("layers", "embed"),
}
# Projections into the residual stream: their init shrinks with depth (GPT-2).
_OUT_PROJECTIONS = ("wo_LNHD", "w_down_LFD", "w_down_LEFD", "shared_w_down_LFD")
# Layer weights kept in float32 whatever the compute dtype: the selection bias moves by steps
# of about 1e-3, which bfloat16 would round away near the scores it is added to.
_FLOAT32_LAYER_WEIGHTS = ("expert_bias_LE",)


class Transformer(nnx.Module):
    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        self.config = config
        std = 0.02
        # GPT-2's residual scaling: output projections shrink with depth.
        out_std = std / math.sqrt(2 * config.num_layers)
        for name, shape in _param_shapes(config).items():
            if "scale" in name:
                value = jnp.ones(shape, jnp.float32)
            elif "bias" in name:
                value = jnp.zeros(shape, jnp.float32)
            else:
                own = name.removeprefix(DENSE).removeprefix(MTP)
                scale = out_std if own in _OUT_PROJECTIONS else std
                value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
            if name.removeprefix(MTP) == "expert_bias_LE":  # moved by the step, not the optimizer
                rate = config.bias_update_rate
                setattr(self, name, ExpertBias(value, logical_axes=LOGICAL[name], rate=rate))
                continue
            setattr(self, name, nnx.Param(value, logical_axes=LOGICAL[name]))
        # --fp8 delayed (the layout the model is built under): the projections' FP8 state,
        # each stack's (the dense stack's named fp8_dense_..., the prediction blocks' fp8_mtp_...).
        shapes = _param_shapes(config)
        ahead = [(MTP, mtp_block(config))] if config.mtp_depth else []
        for prefix, stack in stacks(config) + ahead:
            mine = {
                prefix + k: (spec, shapes[prefix + k][1:])
                for k, spec in PROJECTIONS.items()
                if prefix + k in shapes
            }
            for name, meta in fp8.delayed_state(mine, stack.num_layers).items():
                setattr(self, name, meta)

    def weights(self) -> dict[str, jax.Array]:
        """Every parameter by name, as stored (fp32)."""
        return {name: getattr(self, name)[...] for name in _param_shapes(self.config)}

    def fp8_state(self) -> dict[str, jax.Array]:
        """The FP8 projections' delayed state by name ({} but for --fp8 delayed)."""
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, fp8.Fp8Meta)}

    def __call__(
        self, tokens_BT: jax.Array, docs: Documents | None = None
    ) -> tuple[jax.Array, dict]:
        """Logits, and {"loss": auxiliary loss to add, "metrics": {...}} (MoE; else zero);
        with `docs`, each document of a row is seen alone (see the module docstring)."""
        c, p = self.config, self.weights()
        x_BTD = embed(c, p, tokens_BT, docs)
        x_BTD, aux = run_stacks(c, p, x_BTD, docs, self.fp8_state())
        aux = moe.summarize(c, aux) if c.num_experts else {"loss": 0.0, "metrics": {}}
        return logits(c, p, x_BTD), aux

    def features(self, tokens_BT: jax.Array, docs: Documents | None = None):
        """The last hidden state (final norm applied) and the output head, logits = h @ head,
        for a loss that never holds all logits at once (jaxdist.kernels.fused_loss)."""
        c, p = self.config, self.weights()
        x_BTD = embed(c, p, tokens_BT, docs)
        x_BTD, aux = run_stacks(c, p, x_BTD, docs, self.fp8_state())
        aux = moe.summarize(c, aux) if c.num_experts else {"loss": 0.0, "metrics": {}}
        return final_norm(c, p, x_BTD), head_weight(c, p), aux

    @property
    def mtp_depth(self) -> int:
        """The multi-token prediction modules training runs (`ahead`; 0: none)."""
        return self.config.mtp_depth

    @property
    def mtp_loss_weight(self) -> float:
        """lambda: their mean cross-entropy's weight in the training loss."""
        return self.config.mtp_loss_weight

    def ahead(self, tokens_BT: jax.Array, targets_BT: jax.Array, docs: Documents | None = None):
        """Training's forward with the multi-token prediction modules: `features`' three, then
        per depth k (1..mtp_depth) its last hidden state (its own norm applied: logits = h @
        head), the tokens it predicts (t_{p+k+1} at place p) and where they count
        (models/mtp.py). The auxiliary loss holds the modules' MoE terms too."""
        c, p, fp8_state = self.config, self.weights(), self.fp8_state()
        x_BTD = embed(c, p, tokens_BT, docs)
        x_BTD, stats = run_stacks(c, p, x_BTD, docs, fp8_state)
        depths, ahead_stats = predict_ahead(c, p, x_BTD, tokens_BT, targets_BT, docs, fp8_state)
        if not c.num_experts:
            return final_norm(c, p, x_BTD), head_weight(c, p), {"loss": 0.0, "metrics": {}}, depths
        aux = _with_ahead_moe(c, moe.summarize(c, stats), stats, ahead_stats)
        return final_norm(c, p, x_BTD), head_weight(c, p), aux, depths

    def stages(self) -> Stages:
        """The model cut into pipeline pieces: embed, a run of layers, the head."""
        c = self.config
        if c.mtp_depth:
            # Module k needs the trunk's last hidden state and the embedding, at the last stage.
            raise ConfigError(
                f"pipeline parallelism with multi-token prediction (mtp_depth {c.mtp_depth}) is "
                "not supported; drop the pipeline axis or set mtp_depth 0"
            )
        if c.dense_layers:
            # The pipeline splits one layer stack; this model has two (dense, then MoE).
            raise ConfigError(
                f"pipeline parallelism over a model with dense first layers (dense_layers "
                f"{c.dense_layers}) and MoE layers is not supported; drop the pipeline axis"
            )
        return Stages(
            self.weights(),
            [k for k in _param_shapes(c) if "_L" in k],
            lambda p, t, docs: embed(c, p, t, docs),
            lambda w, x, docs: _stage_body(c, w, x, docs),
            lambda p, x: logits(c, p, x),
            {k: LOGICAL[k] for k in _param_shapes(c)},
            c.compute_dtype,
            lambda p, x: (final_norm(c, p, x), head_weight(c, p)),
        )


def _cast(c: TransformerConfig, name: str, v: jax.Array) -> jax.Array:
    # Cast before use so FSDP gathers and tensor-parallel reductions move compute-dtype bytes.
    # The embedding table and the head are used gathered, their gradients landing where they
    # are stored (embed, head_weight); layer weights keep their stored layout inside the scan
    # body (_stored).
    v = _compute(c, v)
    return v if "_L" in name else constrain(v, LOGICAL[name])


def _compute(c: TransformerConfig, v: jax.Array) -> jax.Array:
    return v.astype(jnp.dtype(c.compute_dtype))


def embed(
    c: TransformerConfig, p: dict, tokens_BT: jax.Array, docs: Documents | None = None
) -> jax.Array:
    table_VD = _compute(c, p["tok_embed_VD"])
    x_BTD = lookup(table_VD, tokens_BT, LOGICAL["tok_embed_VD"], tied=c.tie_embeddings)
    if c.style == "gpt2":
        pos_embed_TD = _cast(c, "pos_embed_TD", p["pos_embed_TD"])
        if docs is None:
            x_BTD = x_BTD + pos_embed_TD[: tokens_BT.shape[1]]
        else:
            x_BTD = x_BTD + jnp.take(pos_embed_TD, docs.positions_BT, axis=0)
    return constrain(x_BTD, ("batch", "seq", "embed"))


def _layers(p: dict) -> dict:
    return {k: v for k, v in p.items() if "_L" in k}


def of_stack(named: dict, prefix: str) -> dict:
    """The entries of one layer stack (stacks' prefix) of a dict of layer weights or their FP8
    state, by their names within the stack: "" the main stack's, DENSE the dense first layers'
    (dense_w_up_LDF, fp8_dense_w_up_... -> w_up_LDF, fp8_w_up_...)."""
    if not prefix:  # neither the dense first layers' nor the prediction modules' (MTP)
        return {k: v for k, v in named.items() if DENSE not in k and MTP not in k}
    return {k.replace(prefix, "", 1): v for k, v in named.items() if prefix in k}


def run_stacks(
    c: TransformerConfig,
    p: dict,
    x_BTD: jax.Array,
    docs: Documents | None = None,
    fp8_state: dict | None = None,
):
    """Every layer stack of the model in order (stacks: the dense first layers, then the rest);
    the statistics of the last, the MoE layers' where the model has experts."""
    layers, fp8_state = _layers(p), fp8_state or {}
    for prefix, stack in stacks(c):
        x_BTD, aux = run_layers(
            stack, of_stack(layers, prefix), x_BTD, docs, of_stack(fp8_state, prefix)
        )
    return x_BTD, aux


def run_layers(
    c: TransformerConfig,
    layers: dict,
    x_BTD: jax.Array,
    docs: Documents | None = None,
    fp8_state: dict | None = None,
):
    """The stacked layers given (all of them, or a pipeline stage's share), in order; with
    their FP8 state (--fp8 delayed), stacked as they are, kept in float32."""
    layers = {k: v if k in _FLOAT32_LAYER_WEIGHTS else _compute(c, v) for k, v in layers.items()}
    if docs is None:
        positions_BT, mask_B1TS = jnp.arange(x_BTD.shape[1])[None], None  # B of 1: broadcast
    else:
        # Built once for all layers, in the form the attention kernel takes (a bool mask, or
        # segment ids for splash attention).
        positions_BT, mask_B1TS = docs.positions_BT, document_mask(c.attention, docs)

    def block(x_BTD, w_and_state):
        w, state = w_and_state
        return _block(c, x_BTD, w, positions_BT, mask_B1TS, state)

    block = jax.checkpoint(block, policy=remat.POLICIES[c.remat])
    return jax.lax.scan(block, x_BTD, (layers, fp8_state or {}))


def predict_ahead(
    c: TransformerConfig,
    p: dict,
    x_BTD: jax.Array,
    tokens_BT: jax.Array,
    targets_BT: jax.Array,
    docs: Documents | None,
    fp8_state: dict,
):
    """The multi-token prediction modules from the trunk's last hidden state (before its final
    norm), depth after depth: [(h_BTD normed, targets_BT, mask_BT)] per depth, and their
    blocks' statistics stacked over the depths (MoE; else {}). Module k: the RMSNorms of the
    embedding of t_{p+k} (the shared table) and of the previous depth's state, side by side
    through eh_proj, then one block of the model's last kind; its output feeds depth k + 1."""
    block = mtp_block(c)
    weights, state = of_stack(p, MTP), of_stack(fp8_state, MTP)
    own = [k for k in weights if k not in _param_shapes(block)]  # norms and eh_proj
    depths, stats = [], []
    for k in range(c.mtp_depth):
        w = {n: _stored(_compute(c, weights[n][k]), LOGICAL[MTP + n][1:]) for n in own}
        ahead_BT, target_BT, mask_BT = mtp.shifted(tokens_BT, targets_BT, docs, k + 1)
        e_BTD = norm(c, embed(c, p, ahead_BT, docs), w["enorm_scale_LD"], None)
        h_BTD = norm(c, x_BTD, w["hnorm_scale_LD"], None)
        eh_BTI = jnp.concatenate([e_BTD, h_BTD], axis=-1)  # HF's order: embedding first
        x_BTD = constrain(
            jnp.einsum("bti,id->btd", eh_BTI, w["eh_proj_LID"]), ("batch", "seq", "embed")
        )
        layer = {n: v[k : k + 1] for n, v in weights.items() if n not in own}
        layer_state = {n: v[k : k + 1] for n, v in state.items()}
        x_BTD, layer_stats = run_layers(block, layer, x_BTD, docs, layer_state)
        depths.append((norm(c, x_BTD, w["head_norm_scale_LD"], None), target_BT, mask_BT))
        stats.append(layer_stats)
    return depths, jax.tree.map(lambda *s: jnp.concatenate(s), *stats)


def _with_ahead_moe(c: TransformerConfig, aux: dict, trunk: dict, ahead: dict) -> dict:
    """moe.summarize's aux with the prediction modules' MoE blocks joined: each block's
    balance and z terms weighted as one more of the model's layers (depth 0 keeps the loss as
    it is), its drops counted in moe_dropped, its loads moving its own selection bias."""
    extra = c.balance_coef * jnp.sum(ahead["balance_loss"]) + c.z_loss_coef * jnp.sum(
        ahead["z_loss"]
    )
    dropped = jnp.sum(trunk["dropped"]) + jnp.sum(ahead["dropped"])
    assigned = jnp.sum(trunk["assigned"]) + jnp.sum(ahead["assigned"])
    loads = {MTP + "expert_bias_LE": ahead["load_E"]} if c.bias_update_rate else {}
    return aux | {
        "loss": aux["loss"] + extra / c.num_layers,
        "expert_load": aux["expert_load"] | loads,
        "metrics": aux["metrics"] | {"moe_dropped": dropped / assigned},
    }


def _stage_body(c: TransformerConfig, layers: dict, x_BTD: jax.Array, docs: Documents | None):
    """A pipeline stage's run of layers: its output and its share of the auxiliary loss (MoE:
    these layers' terms of moe.summarize's mean over all layers; else 0)."""
    x_BTD, aux = run_layers(c, layers, x_BTD, docs)
    if not c.num_experts:
        return x_BTD, jnp.float32(0)
    share = c.balance_coef * jnp.sum(aux["balance_loss"]) + c.z_loss_coef * jnp.sum(aux["z_loss"])
    return x_BTD, share / c.num_layers


def logits(c: TransformerConfig, p: dict, x_BTD: jax.Array) -> jax.Array:
    logits_BTV = jnp.einsum("btd,dv->btv", final_norm(c, p, x_BTD), head_weight(c, p))
    return constrain(logits_BTV, ("batch", "seq", "vocab"))


def final_norm(c: TransformerConfig, p: dict, x_BTD: jax.Array) -> jax.Array:
    return norm(
        c,
        x_BTD,
        _cast(c, "norm_f_scale_D", p["norm_f_scale_D"]),
        _cast(c, "norm_f_bias_D", p["norm_f_bias_D"]) if "norm_f_bias_D" in p else None,
    )


def head_weight(c: TransformerConfig, p: dict) -> jax.Array:
    """The output head [D, V] in the compute dtype: its own weight, or the embedding's."""
    if c.tie_embeddings:
        return gathered(_compute(c, p["tok_embed_VD"]).T, LOGICAL["head_DV"])
    return gathered(_compute(c, p["head_DV"]), LOGICAL["head_DV"])


def _block(c: TransformerConfig, x_BTD, w, positions_BT, mask_B1TS, fp8_state=None):
    # Each layer's weights in their stored layout, as _cast explains. Expert weights stay as
    # stored too: jaxdist.parallel.experts gathers them inside its shard_map.
    w = {k: v if k in EXPERT_WEIGHTS else _stored(v, LOGICAL[k][1:]) for k, v in w.items()}
    w |= fp8_state or {}
    q_BTNH, k_BTGH, v_BTGH = qkv(c, x_BTD, w, positions_BT)
    attn_BTNH = attention(q_BTNH, k_BTGH, v_BTGH, mask_B1TS, c.attention)
    return after_attention(c, x_BTD, attn_BTNH, w)


def _stored(v: jax.Array, logical: tuple[str, ...]) -> jax.Array:
    # A layer's weights keep their stored layout ("param": FSDP-sharded) where they are used,
    # and XLA chooses how to gather them. Pinned replicated instead, XLA's TPU partitioner
    # all-reduced each weight's whole gradient and then sliced it (13.5 GB a step on
    # Llama-2-7B, fsdp=8); left sharded it reduce-scatters, and windows the matmuls (gathers
    # and reductions as collective-permute rings overlapped with the matmul's chunks). GPUs
    # compile the same either way (reduce-scatter).
    return constrain(v, logical, "param")
