"""Generation speed by mesh: `jaxdist generate`'s tokens/s for one prompt.

    python experiments/generate_speed.py                     # ~160M-parameter random Llama
    python experiments/generate_speed.py --meshes "tensor=8;data=8" --new-tokens 64

A random LlamaForCausalLM directory (experiments/hf_import_memory.py makes it) is imported onto
each mesh of 8 fake CPU devices and decodes NEW_TOKENS greedy tokens after a short prompt
from its KV cache (jaxdist/inference/generate.py, models/decode.py); tokens/s counts prefill
and decode, compiled beforehand. The prompt fills every row of the batch axes, so a data axis
multiplies the work of one answer, and FSDP gathers every weight again for each token: for
one prompt, tensor parallelism is the layout that divides the work.

Results: experiments/results/generate_speed.json.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).parent.parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--d-mlp", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--meshes", default="tensor=8;data=4,tensor=2;data=2,fsdp=2,tensor=2;data=8"
    )
    args = parser.parse_args()
    from hf_import_memory import make_model  # this folder's study, beside this one

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp) / "model"
        size = make_model(directory, args)
        # The tiny reference models' BPE (tests/make_hf_fixtures.py): ids fit any vocabulary.
        shutil.copy(ROOT / "tests" / "fixtures" / "hf" / "llama-gqa" / "tokenizer.json", directory)
        for mesh in args.meshes.split(";"):
            # As a user runs it: the command itself, one process per mesh.
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "jaxdist.cli",
                    "generate",
                    f"hf:{directory}",
                    "--prompt",
                    "abcdefghijklmnop",
                    "--max-new-tokens",
                    str(args.new_tokens),
                    "--mesh",
                    mesh,
                    "--devices",
                    "cpu:8",
                    "--json",
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "JAX_PLATFORMS": "cpu"},
            )
            if out.returncode:
                sys.exit(f"jaxdist generate on {mesh} failed:\n{out.stderr}")
            answer = json.loads(out.stdout.strip().splitlines()[-1])
            new, speed = len(answer["new_ids"]), answer["tokens_per_s"]
            rows.append({"mesh": mesh, "new_tokens": new, "tokens_per_s": speed})
            print(f"{mesh:24s} {new} tokens, {speed:6.1f} tokens/s")
    result = {"model": size, "config": vars(args), "device": "8 fake CPU devices"}
    result["rows"] = rows
    path = ROOT / "experiments" / "results" / "generate_speed.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
