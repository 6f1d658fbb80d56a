"""Makes tests/fixtures/hf: tiny random Hugging Face models and their outputs, from
`transformers` itself (the reference jaxdist's import, export and generation are tested
against). Run it with a Python that has torch, transformers and safetensors:

    python tests/make_hf_fixtures.py [NAME ...]   (default: every model)

Each model directory holds what `save_pretrained` writes (config.json, model.safetensors,
generation_config.json), a tiny byte-level BPE tokenizer.json (with tokenizer_config.json naming
its EOS), and reference.safetensors:
`input_ids` [2, 12] and transformers' fp32 `logits` for them, `prompt_ids` (the encoded
PROMPT) and `greedy_ids` (transformers' greedy `generate`, 32 new tokens). versions.json
records the library versions that made them. Seeded: a rerun makes the same models.

rope_frequencies.json: transformers' RoPE inverse frequencies (ROPE_INIT_FUNCTIONS) and
attention factor for a set of config.json RoPE settings, each scaling kind and both spellings.
"""

import json
import pathlib
import sys

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = pathlib.Path(__file__).parent / "fixtures" / "hf"
VOCAB = 300  # not a multiple of 128: jaxdist pads it, and must never produce a padded id
PROMPT = "def main(args):\n    return"
NEW_TOKENS = 32
EOS = "<|endoftext|>"

_TEXT = (
    "import os\nimport sys\n\n\ndef main(args):\n    for name in args:\n        print(name)\n"
    "    return 0\n\n\nclass Reader:\n    def __init__(self, path):\n        self.path = path\n"
    "\n    def read(self):\n        with open(self.path) as f:\n            return f.read()\n"
) * 8


def tokenizer(eos: str = EOS) -> Tokenizer:
    """A byte-level BPE of exactly VOCAB ids (`eos`, the one special token, first; 256 bytes,
    the merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def configs(eos_id: int) -> dict[str, transformers.PretrainedConfig]:
    common = {"vocab_size": VOCAB, "eos_token_id": eos_id, "bos_token_id": eos_id}
    llama = {
        "hidden_size": 32,
        "intermediate_size": 80,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        **common,
    }
    return {
        # grouped-query (2 query heads per kv head), untied, a non-default RoPE base
        "llama-gqa": transformers.LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            **llama,
        ),
        # 4 query heads per kv head, tied embeddings
        "llama-tied": transformers.LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **{**llama, "num_attention_heads": 8},
        ),
        # biases on every attention and MLP projection (one small layer)
        "llama-bias": transformers.LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
            **{**llama, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1},
        ),
        "gpt2": transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=None, **common
        ),
        # Llama 3.1's RoPE scaling, its original context shrunk so that every branch (kept,
        # smoothed, divided by the factor) holds a frequency of head_dim 8
        "llama31": transformers.LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING},
            **llama,
        ),
        # Q, K and V biases without an output bias; tied
        "qwen2": transformers.Qwen2Config(
            num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, **llama
        ),
        # per-head q/k norms; head_dim 16 with 4 heads of a 32-wide model; EOS <|im_end|> and a
        # second one (generation_config.json)
        "qwen3": transformers.Qwen3Config(
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, **llama
        ),
        # a sliding window exactly the context (the longest supported)
        "mistral": transformers.MistralConfig(
            num_key_value_heads=2, sliding_window=64, tie_word_embeddings=False, **llama
        ),
        # 4 experts of 48, top 2, renormalized
        "mixtral": transformers.MixtralConfig(
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            **{**llama, "intermediate_size": 48},
        ),
        # 4 experts of 24, top 2, not renormalized; q/k norms, head_dim 16
        "qwen3-moe": transformers.Qwen3MoeConfig(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            **llama,
        ),
        # latent attention: q through rank 24, kv latent 16, RoPE part 8 (interleaved, yarn
        # with both mscales), values 12 against q.k's 16; every layer dense (no MoE routing)
        "deepseek-v3": transformers.DeepseekV3Config(
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **YARN_MSCALE},
            **DEEPSEEK,
            **llama,
        ),
        # DeepSeek-V2-Lite's shape: a plain q projection, RoPE halves not interleaved; one layer
        "deepseek-v3-lite": transformers.DeepseekV3Config(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **{**DEEPSEEK, "q_lora_rank": None, "rope_interleave": False},
            **{**llama, "num_hidden_layers": 1},
        ),
        # DeepSeek-V3's MoE: a dense first layer (intermediate_size 80), then 2 MoE layers of 8
        # routed experts of 16 (top 2 within the best 2 of 4 groups, sigmoid scores, a random
        # selection bias, weights renormalized and scaled by 2.5) and one shared expert
        "deepseek-v3-moe": transformers.DeepseekV3Config(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **{**DEEPSEEK, **DEEPSEEK_MOE},
            **{**llama, "num_hidden_layers": 3},
        ),
        # 4 experts of 24, top 2, not renormalized, and a shared expert of 40 gated by a
        # sigmoid of the token; Q, K and V biases (Qwen2's attention)
        "qwen2-moe": transformers.Qwen2MoeConfig(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            **llama,
        ),
    }


# MoE sizes are required by the config, unused: first_k_dense_replace covers every layer.
DEEPSEEK = {
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 16,
    "rope_interleave": True,
    "tie_word_embeddings": False,
}
DEEPSEEK_MOE = {
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}
YARN_MSCALE = {
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
QWEN_EOS = "<|im_end|>"  # no name jaxdist.data.tokenizer guesses: EOS must come from the config
UNUSUAL_EOS = ("qwen3",)


def rope_cases() -> list[dict]:
    """transformers' inverse frequencies for config.json RoPE settings: Llama 3.1 8B's own,
    and each kind on a small head (64) so that the ranges (yarn's ramp) fall inside it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    meta = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    meta |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    meta["original_max_position_embeddings"] = 8192
    small = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 4096}
    cases = [
        ({"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 131072,
          "rope_parameters": meta}),
        {**small, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        {**small, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {**small, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}},
        {**small, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 1024}},
        {**small, "head_dim": 32, "rope_theta": 1e6,
         "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
                          "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False,
                          "original_max_position_embeddings": 512}},
    ]  # fmt: skip
    out = []
    for hf in cases:
        config = transformers.LlamaConfig(**hf)
        kind = config.rope_parameters["rope_type"]
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        out.append({"config": hf, "inv_freq": inv_freq.tolist(), "attention_factor": factor})
    return out


def main(names: list[str]) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, config in configs(0).items():
        if names and name not in names:
            continue
        eos = QWEN_EOS if name in UNUSUAL_EOS else EOS
        tok = tokenizer(eos)
        eos_id = tok.token_to_id(eos)
        assert eos_id == 0, eos_id
        prompt_ids = tok.encode(PROMPT).ids
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval().to(torch.float32)
        # Larger than the 0.02 init, so the logits (and greedy choices) depend on every weight.
        with torch.no_grad():
            for n, p in model.named_parameters():
                # q/k norm weights near 0 would make every attention weight alike.
                p.normal_(1.0 if n.endswith(("q_norm.weight", "k_norm.weight")) else 0.0, 0.2)
            # DeepSeek-V3's selection bias is a buffer (zeros): random, so that it matters.
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.2)
        directory = OUT / name
        rng = np.random.default_rng(0)
        input_ids = rng.integers(0, VOCAB, size=(2, 12))
        with torch.no_grad():
            logits = model(torch.tensor(input_ids)).logits.numpy()
            greedy = _greedy(model, prompt_ids, eos_id)
            if name in UNUSUAL_EOS:
                # A second EOS (as Qwen's and Llama 3's lists): the first greedy token from
                # the 4th on not seen before it; generation ends at either.
                g = greedy.tolist()
                eos_ids = [eos_id, next(x for i, x in enumerate(g) if i >= 3 and x not in g[:i])]
                model.generation_config.eos_token_id = eos_ids
                greedy = _greedy(model, prompt_ids, eos_ids)
        model.save_pretrained(directory)
        tok.save(str(directory / "tokenizer.json"))
        tok_config = {"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
        (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
        save_file(
            {
                "input_ids": input_ids.astype(np.int64),
                "logits": logits.astype(np.float32),
                "prompt_ids": np.asarray(prompt_ids, np.int64),
                "greedy_ids": greedy.astype(np.int64),
            },
            str(directory / "reference.safetensors"),
        )
        print(f"{name}: greedy {greedy.tolist()}")
    (OUT / "rope_frequencies.json").write_text(json.dumps(rope_cases(), indent=1) + "\n")
    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "tokenizers": tokenizers.__version__,
        "prompt": PROMPT,
        "new_tokens": NEW_TOKENS,
    }
    (OUT / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    return 0


def _greedy(model, prompt_ids: list[int], eos) -> np.ndarray:
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if isinstance(eos, int) else eos[0],
    )
    return out[0, len(prompt_ids) :].numpy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
