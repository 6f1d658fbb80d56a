"""Text from a model (a Source, jaxdist/hf/source.py): the prompt of a Hugging Face model
checked before anything is loaded, the mesh generation runs on when none is given, the
tokenizer, and the model's decoder (its ModelSpec's) run by jaxdist/inference/generate.py."""

from typing import NamedTuple

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.hf.source import TOKENIZER, Checked, Source
from jaxdist.inference.generate import Generated, SampleConfig


class Text(NamedTuple):
    prompt_ids: list[int]
    generated: Generated
    text: str  # the new ids decoded, EOS left out


def check_prompt(checked: Checked, prompt: str) -> None:
    """hf:PATH: its tokenizer is there and the prompt fits its context, before anything is
    loaded (a run's tokenizer is known once its record is read, at load)."""
    if checked.model is None:
        return
    from jaxdist.data.tokenizer import load
    from jaxdist.inference.generate import check_prompt as fits

    tok_path = checked.model.path / TOKENIZER
    if not tok_path.is_file():
        raise ConfigError(
            f"{checked.model.path} has no {TOKENIZER}; generation needs its tokenizer"
        )
    ids = load(tok_path).encode(prompt).tolist()
    fits(ids, checked.spec.seq_len)


def generation_mesh(checked: Checked, devices: str) -> str:
    """For one prompt: tensor parallelism as wide as the sizes the tensor axis splits allow (kv
    heads, MLP, vocabulary), the rest data (every row of which repeats the prompt)."""
    import jax

    from jaxdist.mesh import setup_devices

    dims = checked.spec.tensor_dims or (1,)  # none: no tensor parallelism
    setup_devices(devices)
    n = jax.device_count()
    t = max(d for d in range(1, n + 1) if n % d == 0 and all(x % d == 0 for x in dims))
    return f"data={n // t},tensor={t}"


def tokenizer(src: Source):
    from jaxdist.data.tokenizer import Tokenizer, load

    if src.tokenizer is None:
        return Tokenizer(None)  # UTF-8 bytes (raw-byte or byte-tokenized runs)
    return load(src.tokenizer, src.eos_id)


def run_generation(src: Source, prompt_ids: list[int], sample: SampleConfig) -> Generated:
    from jaxdist.inference.generate import generate

    if src.spec.decoder is None:
        raise ConfigError(f"{src.spec.name} has no decoder (ModelSpec.decoder): it cannot generate")
    decoder = src.spec.decoder(src.compute_dtype)
    return generate(
        decoder, src.params, src.rules, src.mesh, prompt_ids, sample, src.vocab_size, src.stop_ids()
    )


def generate_text(src: Source, prompt: str, sample: SampleConfig) -> Text:
    """The prompt encoded as plain text (special tokens written in it are not control tokens),
    continued, and the continuation decoded."""
    tok = tokenizer(src)
    prompt_ids = [int(i) for i in tok.encode(prompt)]
    out = run_generation(src, prompt_ids, sample)
    stops = src.stop_ids()
    text = tok.decode(np.asarray([i for i in out.new_ids if i not in stops], np.int64))
    return Text(prompt_ids, out, text)
