"""`jaxdist export-hf` and `jaxdist generate`: Hugging Face models out, and text out of a model
(a run's checkpoint or hf:PATH). The work is the library's (jaxdist/hf/: source, export,
generation); this wires the transformer's adapter (models/hf_adapter.py) and the mesh into it.
"""

import dataclasses
import json as jsonlib
import pathlib
from typing import Annotated, Literal

import tyro

from jaxdist.cli.options import DEFAULT_CACHE, MESH_HELP, Common, computes, devices_and_mesh
from jaxdist.errors import ConfigError
from jaxdist.hf.source import Checked, check, hf_dir, load
from models.hf_adapter import ADAPTER

GENERATE_MESH_HELP = MESH_HELP.partition("; auto:")[0] + (
    "; auto: the kv heads over as many devices as divide them (tensor), the rest data (FSDP "
    "would gather every weight again for each token)"
)


@dataclasses.dataclass(frozen=True)
class ExportHF:
    """Write a run's checkpoint as a Hugging Face model directory (its source's architecture,
    else the one its options imply: Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, GPT-2)."""

    run_dir: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="RUN_DIR")]
    """a run directory (train's --run-dir)"""
    out_dir: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="OUT_DIR")]
    """the Hugging Face model directory to write (it must not exist)"""
    step: int | None = None
    """the checkpoint to export; default: the newest good one"""
    dtype: Literal["float32", "bfloat16"] | None = None
    """default: the dtype of the model the run started from (--init-from), else float32"""
    shard_size_mb: int = 4096
    """safetensors files of at most this size, with an index when there are several"""
    mesh: Annotated[str, tyro.conf.arg(help=MESH_HELP)] = "auto"
    devices: str = "auto"
    """cpu:N for N fake CPU devices; auto uses the accelerators present, else cpu:8"""
    compile_cache: str = DEFAULT_CACHE
    """persistent XLA compilation cache directory, or off"""


@dataclasses.dataclass(frozen=True)
class Generate:
    """Generate text from a run's newest checkpoint or a local Hugging Face model (hf:PATH)."""

    source: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="SOURCE")]
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
    """cpu:N for N fake CPU devices; auto uses the accelerators present, else cpu:8"""
    compile_cache: str = DEFAULT_CACHE
    """persistent XLA compilation cache directory, or off"""


def _load(checked: Checked, mesh: str, devices: str, cache: str, step: int | None = None):
    common = Common(mesh=mesh, devices=devices, compile_cache=cache)
    mesh_, rules, platform = devices_and_mesh(common)
    return load(checked, mesh_, rules, computes(platform)[0], step)


def export_hf(args: ExportHF) -> int:
    from jaxdist.hf.export import export

    if args.shard_size_mb < 1:
        raise ConfigError(f"--shard-size-mb {args.shard_size_mb} must be at least 1")
    if pathlib.Path(args.out_dir).exists():
        raise ConfigError(f"{args.out_dir} exists; export-hf writes a new directory, pass another")
    if hf_dir(args.run_dir) is not None:
        raise ConfigError("export-hf exports a run directory; hf:PATH already is a HF model")
    checked = check(args.run_dir, ADAPTER)  # before any device starts
    src = _load(checked, args.mesh, args.devices, args.compile_cache, args.step)
    files = export(src, pathlib.Path(args.out_dir), args.dtype, args.shard_size_mb << 20)
    import jax

    if jax.process_index() == 0:
        print(jsonlib.dumps({"out_dir": args.out_dir, "files": files}))
    return 0


def generate(args: Generate) -> int:
    from jaxdist.hf.generation import check_prompt, generate_text, generation_mesh
    from jaxdist.inference.generate import SampleConfig, check_unsplit
    from meshes.presets import STANDARD_RULES, get_mesh_preset

    sample = SampleConfig(args.max_new_tokens, args.temperature, args.top_k, args.seed)
    sample.validate()
    if not args.prompt:
        raise ConfigError('pass the text to continue with --prompt "..."')
    checked = check(args.source, ADAPTER)  # before any device starts
    check_prompt(checked, args.prompt)  # hf:PATH: before anything is loaded
    mesh = args.mesh if args.mesh != "auto" else generation_mesh(checked, args.devices)
    check_unsplit(STANDARD_RULES, get_mesh_preset(mesh).mesh.sizes())
    src = _load(checked, mesh, args.devices, args.compile_cache)
    prompt_ids, out, text = generate_text(src, args.prompt, sample)
    import jax

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
