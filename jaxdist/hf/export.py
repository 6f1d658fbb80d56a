"""A model on a mesh (a Source, jaxdist/hf/source.py) written as a Hugging Face model directory.

Export gathers one tensor (one layer of it) at a time and streams it into the safetensors files
of a temporary directory, renamed to OUT_DIR when complete: a failure leaves nothing half made.
Every process takes part in every gather; process 0 writes.

A run on bytes (no tokenizer.json: ids 0..255 are the UTF-8 bytes, EOS 256) is exported with a
tokenizer.json that encodes text to those same ids (`byte_tokenizer`), so that the directory is
a whole model for `jaxdist generate hf:OUT_DIR` and for transformers' AutoTokenizer alike.
"""

import json
import os
import pathlib
import shutil

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.hf.source import TOKENIZER, Source

# Beside tokenizer.json in a model directory: what transformers' AutoTokenizer reads too.
_TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json")


def byte_tokenizer() -> str:
    """A tokenizer.json whose ids are the UTF-8 bytes (0..255) and EOS 256 ("<|endoftext|>"):
    the byte tokenizer (jaxdist.data.tokenizer) as the `tokenizers` library writes one. GPT-2's
    byte-level pre-tokenizer maps each byte to a printable character; a BPE without merges over
    those 256 characters, numbered by their byte, then gives each byte its own id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from jaxdist.data.tokenizer import BYTE_EOS, TRAIN_EOS

    # GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others from U+0100.
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    moved = [b for b in range(256) if b not in kept]
    char = {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(moved)}
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([TRAIN_EOS])
    assert tok.token_to_id(TRAIN_EOS) == BYTE_EOS
    return tok.to_str()


def _gather(x) -> np.ndarray:
    import jax

    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def export(
    src: Source, out_dir: pathlib.Path, dtype: str | None, max_shard_bytes: int
) -> list[str]:
    """Writes `src` as a Hugging Face model directory in `dtype` (default: the source's);
    returns the files written (none on processes other than 0)."""
    import jax
    import ml_dtypes

    from jaxdist.hf.safetensors_io import Planned, write

    out_dir = pathlib.Path(out_dir)
    if out_dir.exists():
        raise ConfigError(f"{out_dir} exists; export-hf writes a new directory, pass another")
    dtype = dtype or src.dtype
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {t.name: t for t in src.adapter.to_hf(src.spec.config, src.vocab_size)}
    plan = [Planned(t.name, t.shape, np_dtype) for t in tensors.values()]
    last: dict = {}

    def produce(p: Planned) -> np.ndarray:
        t = tensors[p.name]
        if t.ours not in src.params:
            return t.convert(None).astype(np_dtype)
        key = (t.ours, t.layer)
        if key not in last:  # one gathered tensor (layer) at a time, reused by q, k and v
            last.clear()
            x = src.params[t.ours]
            last[key] = _gather(x if t.layer is None else x[t.layer])
        return t.convert(last[key]).astype(np_dtype)

    writer = jax.process_index() == 0
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        if writer:
            tmp.mkdir(parents=True)
        files = write(tmp, plan, produce, max_shard_bytes) if writer else []
        if not writer:  # the other processes take part in every gather, in the same order
            for p in plan:
                produce(p)
            return []
        _write_beside(src, tmp, dtype)
        files += [p.name for p in sorted(tmp.iterdir()) if p.name not in files]
        os.rename(tmp, out_dir)
        return files
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_beside(src: Source, directory: pathlib.Path, dtype: str) -> None:
    """What goes beside the weights: config.json, generation_config.json (the source's, else
    EOS and BOS), and the tokenizer with the source's own files for it."""
    config = src.adapter.hf_config(
        src.spec.config, src.vocab_size, src.hf_config, dtype, src.eos_id
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen_src = src.source_dir / "generation_config.json" if src.source_dir else None
    if gen_src is not None and gen_src.is_file():
        shutil.copyfile(gen_src, directory / "generation_config.json")
    else:
        gen = {"eos_token_id": src.eos_id, "bos_token_id": config.get("bos_token_id")}
        gen = {k: v for k, v in gen.items() if v is not None}
        (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    extras = [src.tokenizer] if src.tokenizer else []
    theirs = src.source_dir / TOKENIZER if src.source_dir is not None else None
    if src.tokenizer and theirs and theirs.is_file():
        if theirs.read_bytes() == src.tokenizer.read_bytes():  # the source's tokenizer
            extras += [src.source_dir / n for n in _TOKENIZER_EXTRAS]
    for f in extras:
        if f.is_file():
            shutil.copyfile(f, directory / f.name)
    if src.tokenizer is None:  # a run on bytes: their tokenizer, written out
        from jaxdist.data.tokenizer import TRAIN_EOS

        (directory / TOKENIZER).write_text(byte_tokenizer())
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": TRAIN_EOS}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
