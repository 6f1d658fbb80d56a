"""`jaxdist export-hf` and `jaxdist generate`: Hugging Face models out, and text out of a model
(a run's checkpoint or hf:PATH, loaded onto a mesh by jaxdist/cli/hf_source.py).

Export gathers one tensor (one layer of it) at a time and streams it into the safetensors files
of a temporary directory, renamed to OUT_DIR when complete: a failure leaves nothing half made.
"""

import dataclasses
import json as jsonlib
import os
import pathlib
import shutil
from typing import Annotated, Literal

import numpy as np
import tyro

from jaxdist.cli.hf_source import TOKENIZER, Source, load_source
from jaxdist.cli.options import DEFAULT_CACHE, MESH_HELP
from jaxdist.errors import ConfigError

GENERATE_MESH_HELP = MESH_HELP.partition("; auto:")[0] + (
    "; auto: the kv heads over as many devices as divide them (tensor), the rest data (FSDP "
    "would gather every weight again for each token)"
)
# Beside tokenizer.json in a model directory: what transformers' AutoTokenizer reads too.
_TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass(frozen=True)
class ExportHF:
    """Write a run's checkpoint as a Hugging Face model directory (Llama or GPT-2)."""

    run_dir: tyro.conf.Positional[str]
    out_dir: tyro.conf.Positional[str]
    step: int | None = None
    """the checkpoint to export; default: the newest good one"""
    dtype: Literal["float32", "bfloat16"] | None = None
    """default: the dtype of the model the run started from (--init-from), else float32"""
    shard_size_mb: int = 4096
    """safetensors files of at most this size, with an index when there are several"""
    mesh: Annotated[str, tyro.conf.arg(help=MESH_HELP)] = "auto"
    devices: str = "auto"
    compile_cache: str = DEFAULT_CACHE


@dataclasses.dataclass(frozen=True)
class Generate:
    """Generate text from a run's newest checkpoint or a local Hugging Face model (hf:PATH)."""

    source: tyro.conf.Positional[str]
    """RUN_DIR, or hf:PATH (a directory with config.json, safetensors, tokenizer.json)"""
    prompt: str = ""
    """the text to continue, encoded with the model's tokenizer"""
    max_new_tokens: int = 64
    """at most this many new tokens (fewer at EOS or at the end of the model's context)"""
    temperature: float = 0.0
    """0: greedy; else sample at this temperature (with --seed)"""
    top_k: int | None = None
    """sample among the K most likely tokens only"""
    seed: int = 0
    """the random seed of sampling"""
    json: bool = False
    """print one JSON object: prompt_ids, new_ids, text, tokens_per_s"""
    mesh: Annotated[str, tyro.conf.arg(help=GENERATE_MESH_HELP)] = "auto"
    devices: str = "auto"
    compile_cache: str = DEFAULT_CACHE


def _gather(x) -> np.ndarray:
    import jax

    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def export(
    src: Source, out_dir: pathlib.Path, dtype: str | None, max_shard_bytes: int
) -> list[str]:
    """Writes `src` as a Hugging Face model directory; returns the files written."""
    import jax
    import ml_dtypes

    from jaxdist.hf.safetensors_io import Planned, write
    from models.hf import export_config, export_pieces, hf_tensor

    out_dir = pathlib.Path(out_dir)
    if out_dir.exists():
        raise ConfigError(f"{out_dir} exists; export-hf writes a new directory, pass another")
    dtype = dtype or src.dtype
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    pieces, cfg = export_pieces(src.config, src.vocab_size)
    plan, source = [], {}
    for piece in pieces:
        for layer in range(cfg.num_layers) if "_L" in piece.ours else [None]:
            p = Planned(piece.name(layer), piece.hf_shape, np_dtype)
            plan.append(p)
            source[p.name] = (piece, layer)
    last: dict = {}

    def produce(p: Planned) -> np.ndarray:
        piece, layer = source[p.name]
        if piece.ours not in src.params:
            return hf_tensor(piece, None).astype(np_dtype)
        key = (piece.ours, layer)
        if key not in last:  # one gathered tensor (layer) at a time, reused by q, k and v
            last.clear()
            x = src.params[piece.ours]
            last[key] = _gather(x if layer is None else x[layer])
        return hf_tensor(piece, last[key]).astype(np_dtype)

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
        config = export_config(cfg, src.vocab_size, src.hf_config, dtype, src.eos_id)
        (tmp / "config.json").write_text(jsonlib.dumps(config, indent=2) + "\n")
        gen_src = src.source_dir / "generation_config.json" if src.source_dir else None
        if gen_src is not None and gen_src.is_file():
            shutil.copyfile(gen_src, tmp / "generation_config.json")
        else:
            gen = {"eos_token_id": src.eos_id, "bos_token_id": config.get("bos_token_id")}
            gen = {k: v for k, v in gen.items() if v is not None}
            (tmp / "generation_config.json").write_text(jsonlib.dumps(gen, indent=2) + "\n")
        extras = [src.tokenizer] if src.tokenizer else []
        theirs = src.source_dir / TOKENIZER if src.source_dir is not None else None
        if src.tokenizer and theirs and theirs.is_file():
            if theirs.read_bytes() == src.tokenizer.read_bytes():  # the source's tokenizer
                extras += [src.source_dir / n for n in _TOKENIZER_EXTRAS]
        for f in extras:
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
        files += [p.name for p in sorted(tmp.iterdir()) if p.name not in files]
        os.rename(tmp, out_dir)
        return files
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def export_hf(args: ExportHF) -> int:
    if args.shard_size_mb < 1:
        raise ConfigError(f"--shard-size-mb {args.shard_size_mb} must be at least 1")
    if pathlib.Path(args.out_dir).exists():
        raise ConfigError(f"{args.out_dir} exists; export-hf writes a new directory, pass another")
    if args.run_dir.startswith("hf:"):
        raise ConfigError("export-hf exports a run directory; hf:PATH already is a HF model")
    src = load_source(args.run_dir, args.mesh, args.devices, args.compile_cache, args.step)
    files = export(src, pathlib.Path(args.out_dir), args.dtype, args.shard_size_mb << 20)
    import jax

    if jax.process_index() == 0:
        print(jsonlib.dumps({"out_dir": args.out_dir, "files": files}))
    return 0


def _tokenizer(src: Source):
    from jaxdist.data.tokenizer import Tokenizer

    if src.tokenizer is None:
        return Tokenizer(None)  # UTF-8 bytes (raw-byte or byte-tokenized runs)
    return Tokenizer(src.tokenizer.read_text(), str(src.tokenizer))


def _generation_mesh(source: str, devices: str) -> str:
    """For one prompt: tensor parallelism as wide as the kv heads and MLP allow, the rest data
    (every row of which repeats the prompt)."""
    import jax

    from jaxdist.cli.hf_source import check_source, read_record
    from jaxdist.mesh import setup_devices

    check_source(source)
    if source.startswith("hf:"):
        from models.hf import open_model

        config = open_model(source).config
    else:
        from models.presets import from_record

        config = from_record(read_record(pathlib.Path(source)).get("model", {}))
    setup_devices(devices)
    n = jax.device_count()
    t = max(
        d
        for d in range(1, n + 1)
        if n % d == 0
        and config.num_kv_heads % d == 0
        and config.d_mlp % d == 0
        and config.vocab_size % d == 0
    )
    return f"data={n // t},tensor={t}"


def generate(args: Generate) -> int:
    from jaxdist.inference.generate import SampleConfig

    sample = SampleConfig(args.max_new_tokens, args.temperature, args.top_k, args.seed)
    sample.validate()
    if not args.prompt:
        raise ConfigError('pass the text to continue with --prompt "..."')
    if args.source.startswith("hf:"):
        from jaxdist.inference.generate import check_prompt
        from models.hf import open_model

        model = open_model(args.source)  # the prompt is checked before anything is loaded
        tok_path = model.path / TOKENIZER
        if not tok_path.is_file():
            raise ConfigError(f"{model.path} has no {TOKENIZER}; generation needs its tokenizer")
        from jaxdist.data.tokenizer import Tokenizer

        check_prompt(
            Tokenizer(tok_path.read_text(), str(tok_path)).encode(args.prompt).tolist(),
            model.config.seq_len,
        )
    mesh = args.mesh if args.mesh != "auto" else _generation_mesh(args.source, args.devices)
    src = load_source(args.source, mesh, args.devices, args.compile_cache)
    tokenizer = _tokenizer(src)
    # Text as plain text: special tokens written in the prompt are not control tokens.
    prompt_ids = [int(i) for i in tokenizer.encode(args.prompt)]
    out = run_generation(src, prompt_ids, sample)
    import jax

    text = tokenizer.decode(np.asarray([i for i in out.new_ids if i != src.eos_id], np.int64))
    if jax.process_index() == 0:
        if args.json:
            print(
                jsonlib.dumps(
                    {
                        "prompt_ids": prompt_ids,
                        "new_ids": out.new_ids,
                        "text": text,
                        "tokens_per_s": out.tokens_per_s,
                    }
                )
            )
        else:
            print(args.prompt + text)
            print(f"[{len(out.new_ids)} tokens, {out.tokens_per_s:.1f} tokens/s]")
    return 0


def run_generation(src: Source, prompt_ids: list[int], sample):
    from jaxdist.inference.generate import Decoder
    from jaxdist.inference.generate import generate as gen
    from models import decode

    c = src.config
    decode.check(c)
    decoder = Decoder(
        forward=lambda p, t, cache, pos: decode.forward(c, p, t, cache, pos),
        init_cache=lambda rows, length: decode.init_cache(c, rows, length),
        cache_logical=decode.CACHE_LOGICAL,
        context=c.seq_len,
    )
    return gen(
        decoder, src.params, src.rules, src.mesh, prompt_ids, sample, src.vocab_size, src.eos_id
    )
