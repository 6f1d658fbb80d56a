"""Named model sizes. GPT-2 style presets match the peer baselines' architecture exactly.

Published architectures are data: models/configs/NAME.json is a Hugging Face config.json as
its authors publish it (Llama 2 and 3.1, Mixtral), read as `hf:PATH` reads one (models/hf_config.py)
and named NAME: the architecture, randomly initialized."""

import dataclasses
import json
import pathlib

from jaxdist.data import padded_vocab
from jaxdist.errors import ConfigError
from jaxdist.hf.source import hf_dir
from jaxdist.model import ModelSpec
from models.transformer_config import TransformerConfig

BYTE_VOCAB = 256  # the embedded default corpus is read as bytes
GPT_VOCAB = 50304  # GPT-2's 50257 rounded up to a multiple of 128 for tiling

# The accelerator-sized presets save matmul and attention-kernel outputs and recompute the
# element-wise rest in the backward pass (remat "dots", torch.compile's choice): on one H200 this
# fits where the torch.compile peer fits (gpt2-124m at batch 32, 1b at batch 8), where keeping
# everything would need twice its memory; the recomputed work is memory-bound element-wise
# kernels, not matmuls. The tiny presets (tests, CPU) keep everything.
_DOTS = {"remat": "dots"}

PRESETS: dict[str, TransformerConfig] = {
    c.name: c
    for c in [
        TransformerConfig("tiny", "gpt2", 2, 128, 4, 4, 512, BYTE_VOCAB, 128),
        TransformerConfig("tiny-llama", "llama", 2, 128, 4, 2, 384, BYTE_VOCAB, 128),
        TransformerConfig("gpt2-124m", "gpt2", 12, 768, 12, 12, 3072, GPT_VOCAB, 1024, **_DOTS),
        TransformerConfig("llama-124m", "llama", 12, 768, 12, 4, 2048, GPT_VOCAB, 1024, **_DOTS),
        TransformerConfig("1b", "gpt2", 16, 2048, 16, 16, 8192, GPT_VOCAB, 2048, **_DOTS),
        TransformerConfig("llama-1b", "llama", 16, 2048, 16, 8, 5632, GPT_VOCAB, 2048, **_DOTS),
        # Mixtral-style: 8 SwiGLU experts, top-2, every layer.
        TransformerConfig(
            "tiny-moe", "llama", 2, 128, 4, 2, 256, BYTE_VOCAB, 128, num_experts=8, top_k=2
        ),
        TransformerConfig(
            "moe-1b",
            "llama",
            16,
            2048,
            16,
            8,
            4096,
            GPT_VOCAB,
            2048,
            num_experts=8,
            top_k=2,
            **_DOTS,
        ),
    ]
}


CONFIGS = pathlib.Path(__file__).parent / "configs"


def _published() -> dict[str, TransformerConfig]:
    from models.hf_config import config_from_hf

    out = {}
    for path in sorted(CONFIGS.glob("*.json")):
        config, _ = config_from_hf(json.loads(path.read_text()), path.stem, str(path))
        # Accelerator-sized, all of them; the main model as published (DeepSeek-V3's 671B,
        # its multi-token prediction module apart: mtp_depth=1 adds it, as it was trained).
        out[path.stem] = dataclasses.replace(config, **_DOTS, mtp_depth=0)
    return out


PRESETS |= _published()


def get_model_config(name: str, **overrides) -> TransformerConfig:
    """A preset with overrides, or `custom`: every size given in `overrides`; or hf:PATH, a
    local Hugging Face model directory's architecture (its config.json; models/hf_config.py)."""
    path = hf_dir(name)
    if path is not None:
        from models.hf_config import checkpoint_mtp, config_from_hf, read_config

        try:
            config, _ = config_from_hf(read_config(path), f"hf:{path.name}", str(path))
            config = checkpoint_mtp(config, path, f"hf:{path}")
            return dataclasses.replace(config, **overrides)
        except ValueError as e:
            raise ConfigError(f"--model {name}: {e}") from None
    if name == "custom":
        try:
            return TransformerConfig(name="custom", **overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--model custom: {e}") from None
    if name not in PRESETS:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(PRESETS)}")
    try:
        return dataclasses.replace(PRESETS[name], **overrides)
    except ValueError as e:  # the config's own checks
        raise ConfigError(str(e)) from None


def with_data_vocab(config: TransformerConfig, data_vocab: int) -> TransformerConfig:
    """The preset with the data's vocabulary: raw bytes keep the preset's (256, or GPT-2's
    padded 50304 for the large presets, trained on bytes); tokenized data replaces it, padded
    up to a multiple of 128 for the matmul tiles (the loss never predicts a padded id)."""
    if data_vocab == BYTE_VOCAB and data_vocab <= config.vocab_size:
        return config
    return dataclasses.replace(config, vocab_size=padded_vocab(data_vocab))


def from_record(fields: dict) -> TransformerConfig:
    """The model a run recorded in its config.json ("model")."""
    try:
        return TransformerConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the run's recorded model is not one this version knows ({e})") from None


def model_spec(config: TransformerConfig) -> ModelSpec:
    """What the training loop, generation and export need of this model. The model's code
    loads here, not with the presets' names (a flag or --help reads those without jax)."""
    from models import decode
    from models.transformer import Transformer

    return ModelSpec(
        name=config.name,
        init=lambda rngs: Transformer(config, rngs),
        seq_len=config.seq_len,
        vocab_size=config.vocab_size,
        flops_per_token=config.flops_per_token(),
        config=config,
        decoder=lambda compute_dtype: decode.decoder(decode.generating(config, compute_dtype)),
        # What the tensor axis splits (meshes/presets.py): kv heads (so heads), MLP, vocabulary.
        tensor_dims=(config.num_kv_heads, config.d_mlp, config.vocab_size),
    )
