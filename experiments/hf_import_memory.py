"""Peak host memory of importing a Hugging Face model into a mesh, against the model's size.

    python experiments/hf_import_memory.py                     # ~160M-parameter Llama, fp32
    python experiments/hf_import_memory.py --layers 4 --d-model 512 --vocab 8000

Writes a random LlamaForCausalLM directory (config.json and one model.safetensors) of the given
size, then, for each mesh, imports it in a fresh process (models/hf.py load: every device's
shard read as slices of the file) and reports the process's peak resident memory during the
import (the kernel's high-water mark, reset just before) above its resident memory then (JAX
started, the program's own imports done), beside: the file's size, the bytes the
process's devices hold (its shards: on fake CPU devices, device memory is host memory, so a
replicated layout holds one copy per device), and the largest single tensor. The import's
promise is peak ~= shards held + at most one whole tensor in conversion; a naive import (whole
file, then device_put) would add the whole model on top.

Results: experiments/results/hf_import_memory.json.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).parent.parent


def make_model(directory: pathlib.Path, args) -> dict:
    import numpy as np

    from jaxdist.hf.safetensors_io import Planned, write
    from models.hf import config_from_hf, pieces

    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.d_model,
        "intermediate_size": args.d_mlp,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "vocab_size": args.vocab,
        "tie_word_embeddings": False,
    }
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf))
    config, vocab = config_from_hf(hf, "probe", str(directory))
    plan = []
    for piece in pieces(config, vocab, 0):
        for layer in range(config.num_layers) if "_L" in piece.ours else [None]:
            plan.append(Planned(piece.name(layer), piece.hf_shape, np.dtype(np.float32)))
    rng = np.random.default_rng(0)
    write(
        directory,
        plan,
        lambda p: rng.standard_normal(p.shape, dtype=np.float32) * 0.02,
        1 << 40,
    )
    return {
        "params": sum(p.nbytes for p in plan) // 4,
        "file_bytes": (directory / "model.safetensors").stat().st_size,
        "largest_tensor_bytes": max(p.nbytes for p in plan),
    }


def _status_bytes(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(directory: str, mesh_spec: str) -> dict:
    """In this (fresh) process: the import's peak RSS above the baseline."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from flax import nnx

    from jaxdist.mesh import build_mesh, parse_mesh
    from jaxdist.rules import state_shardings
    from meshes.presets import STANDARD_RULES
    from models.hf import load, open_model
    from models.transformer import Transformer

    model = open_model(pathlib.Path(directory))
    mesh = build_mesh(parse_mesh(mesh_spec))
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(model.config, nnx.Rngs(0))))
    shardings = dict(
        jax.tree_util.tree_flatten_with_path(state_shardings(abstract, STANDARD_RULES, mesh))[0]
    )
    targets = {
        path[0].key: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[path])
        for path, a in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    jax.block_until_ready(jax.numpy.zeros(8))  # the backend up before the baseline
    # The kernel's high-water mark, reset here ("5" to clear_refs), so the peak is the
    # import's own and not an earlier transient's.
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    base = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    params = load(model, targets)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    held = sum(s.data.nbytes for x in params.values() for s in x.addressable_shards)
    return {
        "mesh": mesh_spec,
        "peak_above_baseline_bytes": peak - base,
        "shards_held_bytes": held,
        "load_s": seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--d-mlp", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--meshes", default="fsdp=8;data=2,fsdp=2,tensor=2;data=8")
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp) / "model"
        size = make_model(directory, args)
        rows = []
        for mesh_spec in args.meshes.split(";"):
            out = subprocess.run(
                [sys.executable, __file__, "--measure", str(directory), mesh_spec],
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            extra = row["peak_above_baseline_bytes"] - row["shards_held_bytes"]
            row["peak_minus_shards_bytes"] = extra
            row["peak_minus_shards_over_largest_tensor"] = extra / size["largest_tensor_bytes"]
            rows.append(row)
            mib = 1 << 20
            print(
                f"{mesh_spec:24s} peak +{row['peak_above_baseline_bytes'] / mib:7.0f} MiB, "
                f"shards held {row['shards_held_bytes'] / mib:7.0f} MiB, beyond them "
                f"{extra / mib:6.0f} MiB (largest tensor {size['largest_tensor_bytes'] / mib:.0f}"
                f" MiB; file {size['file_bytes'] / mib:.0f} MiB), {row['load_s']:.1f} s"
            )
    result = {"model": size, "config": vars(args) | {"measure": None}, "rows": rows}
    out_path = ROOT / "experiments" / "results" / "hf_import_memory.json"
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
