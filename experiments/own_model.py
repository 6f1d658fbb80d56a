"""Your own model, trained by jaxdist from Python: a causal MLP-mixer over bytes, defined here.

    python experiments/own_model.py --mesh data=2,fsdp=2,tensor=2 --steps 30 --run-dir DIR

Every parameter names its dims with logical axes (jaxdist.LOGICAL_AXES); the standard rule
table (meshes.presets) maps them onto the mesh, so `fsdp` splits each weight's `embed` dim and
`tensor` its `mlp` and `vocab` dims. Changing --mesh changes the layout, not the losses.

The model is called as `model(tokens_BT, docs=None)` (jaxdist.model): on tokenized data with
document masking the step passes the packed documents (jaxdist.kernels.documents), and the mixing
stays inside each document, at positions that restart with it.

Legend: B batch  T seq (target position)  S seq (source position)  D embed  F mlp  V vocab
"""

import argparse
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
from flax import nnx

import jaxdist
from jaxdist.kernels.documents import Documents, attention_mask
from jaxdist.rules import constrain
from meshes.presets import STANDARD_RULES


@dataclasses.dataclass(frozen=True)
class MixerConfig:
    num_layers: int = 2
    d_model: int = 64
    d_mlp: int = 256
    seq_len: int = 64
    vocab_size: int = 256  # bytes


def _param(rngs: nnx.Rngs, shape, axes, std=0.02) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape), logical_axes=axes)


def _use(p: nnx.Param) -> jax.Array:
    # Laid out for compute where used: under FSDP the weight is gathered here (ZeRO-3).
    return constrain(p[...], p.logical_axes)


def _norm(x_BTD: jax.Array, scale: nnx.Param) -> jax.Array:
    return x_BTD * jax.lax.rsqrt(jnp.mean(x_BTD**2, -1, keepdims=True) + 1e-5) * _use(scale)


class MixerBlock(nnx.Module):
    def __init__(self, c: MixerConfig, rngs: nnx.Rngs):
        T, D, F = c.seq_len, c.d_model, c.d_mlp
        self.mix_TS = _param(rngs, (T, T), ("seq", "seq"))  # causal: only s <= t is used
        self.norm1_D = nnx.Param(jnp.ones((D,)), logical_axes=("embed",))
        self.norm2_D = nnx.Param(jnp.ones((D,)), logical_axes=("embed",))
        self.w_up_DF = _param(rngs, (D, F), ("embed", "mlp"))
        self.w_down_FD = _param(rngs, (F, D), ("mlp", "embed"), 0.02 / math.sqrt(2 * c.num_layers))

    def __call__(self, x_BTD: jax.Array, docs: Documents | None) -> jax.Array:
        T = x_BTD.shape[1]
        if docs is None:
            mix_TS = jnp.tril(_use(self.mix_TS)[:T, :T])
            x_BTD = x_BTD + jnp.einsum("ts,bsd->btd", mix_TS, _norm(x_BTD, self.norm1_D))
        else:
            # Weight (t, s) is the mixer's for their positions within their document; zero
            # between two documents.
            pos_BT = docs.positions_BT
            mix_BTS = _use(self.mix_TS)[pos_BT[:, :, None], pos_BT[:, None, :]]
            keep_BTS = attention_mask(docs)[:, 0] & jnp.tril(jnp.ones((T, T), bool))
            mix_BTS = jnp.where(keep_BTS, mix_BTS, 0)
            x_BTD = x_BTD + jnp.einsum("bts,bsd->btd", mix_BTS, _norm(x_BTD, self.norm1_D))
        h_BTF = jax.nn.gelu(_norm(x_BTD, self.norm2_D) @ _use(self.w_up_DF))
        h_BTF = constrain(h_BTF, ("batch", "seq", "mlp"))
        return constrain(x_BTD + h_BTF @ _use(self.w_down_FD), ("batch", "seq", "embed"))


class MixerLM(nnx.Module):
    """tokens [B, T] int32 (and packed documents, or None) -> (logits [B, T, V],
    {"loss": 0.0, "metrics": {}})."""

    def __init__(self, c: MixerConfig, rngs: nnx.Rngs):
        self.embed_VD = _param(rngs, (c.vocab_size, c.d_model), ("vocab", "embed"))
        self.blocks = nnx.List([MixerBlock(c, rngs) for _ in range(c.num_layers)])
        self.norm_f_D = nnx.Param(jnp.ones((c.d_model,)), logical_axes=("embed",))
        self.head_DV = _param(rngs, (c.d_model, c.vocab_size), ("embed", "vocab"))

    def __call__(
        self, tokens_BT: jax.Array, docs: Documents | None = None
    ) -> tuple[jax.Array, dict]:
        x_BTD = constrain(
            jnp.take(_use(self.embed_VD), tokens_BT, axis=0), ("batch", "seq", "embed")
        )
        for block in self.blocks:
            x_BTD = block(x_BTD, docs)
        logits_BTV = _norm(x_BTD, self.norm_f_D) @ _use(self.head_DV)
        return constrain(logits_BTV, ("batch", "seq", "vocab")), {"loss": 0.0, "metrics": {}}


def model_spec(c: MixerConfig = MixerConfig()) -> jaxdist.ModelSpec:
    # Training FLOPs per token: 6 x (matmul weights) + 6 x the token mixing (T x D per layer).
    weights = c.num_layers * 2 * c.d_model * c.d_mlp + c.d_model * c.vocab_size
    flops = 6 * weights + 6 * c.num_layers * c.seq_len * c.d_model
    return jaxdist.ModelSpec("mixer-lm", lambda r: MixerLM(c, r), c.seq_len, c.vocab_size, flops, c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="data=2,fsdp=2,tensor=2", help="axis=size,... layout")
    ap.add_argument("--devices", default="cpu:8", help="cpu:N fake CPU devices, or auto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--run-dir", default=None, help="default runs/<time>")
    args = ap.parse_args()

    jaxdist.setup_devices(args.devices)  # before anything starts JAX's backends
    mesh = jaxdist.make_mesh(args.mesh)
    config = jaxdist.RunConfig(
        data=jaxdist.DataConfig(batch_size=args.batch_size, seed=args.seed),  # embedded corpus
        optim=jaxdist.OptimConfig(warmup_steps=min(10, args.steps - 1)),
        loop=jaxdist.LoopConfig(
            steps=args.steps, log_every=args.log_every, seed=args.seed, run_dir=args.run_dir
        ),
    )
    summary = jaxdist.fit(model_spec(), mesh, STANDARD_RULES, config)
    print(json.dumps({k: summary[k] for k in ("mesh", "params", "first_loss", "final_loss")}))


if __name__ == "__main__":
    main()
