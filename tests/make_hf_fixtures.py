"""Makes tests/fixtures/hf: tiny random Hugging Face models and their outputs, from
`transformers` itself (the reference jaxdist's import, export and generation are tested
against). Run it with a Python that has torch, transformers and safetensors:

    python tests/make_hf_fixtures.py

Each model directory holds what `save_pretrained` writes (config.json, model.safetensors,
generation_config.json), a tiny byte-level BPE tokenizer.json, and reference.safetensors:
`input_ids` [2, 12] and transformers' fp32 `logits` for them, `prompt_ids` (the encoded
PROMPT) and `greedy_ids` (transformers' greedy `generate`, 32 new tokens). versions.json
records the library versions that made them. Seeded: a rerun makes the same models.
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


def tokenizer() -> Tokenizer:
    """A byte-level BPE of exactly VOCAB ids (256 bytes, the merges, EOS last)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
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
    }


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    eos_id = tok.token_to_id(EOS)
    prompt_ids = tok.encode(PROMPT).ids
    for name, config in configs(eos_id).items():
        torch.manual_seed(0)
        cls = transformers.GPT2LMHeadModel if name == "gpt2" else transformers.LlamaForCausalLM
        model = cls(config).eval().to(torch.float32)
        # Larger than the 0.02 init, so the logits (and greedy choices) depend on every weight.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        directory = OUT / name
        model.save_pretrained(directory)
        tok.save(str(directory / "tokenizer.json"))
        rng = np.random.default_rng(0)
        input_ids = rng.integers(0, VOCAB, size=(2, 12))
        with torch.no_grad():
            logits = model(torch.tensor(input_ids)).logits.numpy()
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=eos_id,
            )
        greedy = out[0, len(prompt_ids) :].numpy()
        save_file(
            {
                "input_ids": input_ids.astype(np.int64),
                "logits": logits.astype(np.float32),
                "prompt_ids": np.asarray(prompt_ids, np.int64),
                "greedy_ids": greedy.astype(np.int64),
            },
            str(directory / "reference.safetensors"),
        )
        eos_at = list(greedy).index(eos_id) if eos_id in greedy else None
        print(f"{name}: greedy {len(greedy)} tokens, EOS at {eos_at}")
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


if __name__ == "__main__":
    sys.exit(main())
