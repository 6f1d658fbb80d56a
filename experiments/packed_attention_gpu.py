"""Packed documents on the GPU: does the document-masked train step stay on cuDNN's fused
attention? Compiled for an H100/H200 from a CPU host, no GPU needed.

    JAX_PLATFORMS=cpu python experiments/packed_attention_gpu.py --target-config H200.txtpb

Needs the CUDA compiler plugin beside jax (`jax-cuda13-pjrt` and `jax-cuda13-plugin` 0.11.2,
`nvidia-cudnn-cu13` with --no-deps; ptxas and libdevice from `nvidia-cuda-nvcc` and
`nvidia-nvvm` where no CUDA is installed; `--cuda-dir` points XLA at them) and a
GpuTargetConfigProto text for the card (transcribed from XLA's
`xla/backends/gpu/target_config/specs`). For jaxdist's own train step (`jaxdist.step.build`, the
same code `jaxdist train` runs; bf16, cuDNN attention as `jaxdist train` picks on a GPU), for a
GPT-2 style and a Llama style model, with and without packed documents, it prints the cuDNN
custom calls of the compiled program and XLA's temporary memory. Fused means: the attention is
a `__cudnn$fmha*` custom call forward and backward (with documents the mask enters as a dense
[B, 1, T, T] bias: `__cudnn$fmhaScaleBiasSoftmax`), and no [B, N, T, T] score tensor is
materialized by XLA ops.
"""

import argparse
import json
import os
import re


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target-config", required=True, help="GpuTargetConfigProto text file")
    parser.add_argument("--cuda-dir", help="directory holding nvvm/libdevice and bin/ptxas")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.cuda_dir:
        flag = f"--xla_gpu_cuda_data_dir={args.cuda_dir}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

    from jax.experimental import topologies

    from jaxdist.config import OptimConfig
    from jaxdist.layout import Layout
    from jaxdist.mesh import build_mesh, parse_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.step import Vocab, build
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    with open(args.target_config) as f:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=f.read(), topology="1x1x1"
        )
    mesh = build_mesh(parse_mesh("data=1"), topology.devices)
    B, T = args.batch_size, args.seq_len
    for preset in ("gpt2-124m", "llama-124m"):
        cfg = get_model_config(
            preset, attention="cudnn", compute_dtype="bfloat16", seq_len=T, num_layers=4
        )
        model = model_spec(cfg)
        tx, lr = make_optimizer(OptimConfig(), 10)
        for packed in (False, True):
            vocab = Vocab(cfg.vocab_size, 0 if packed else None)
            at = Layout.on(mesh, STANDARD_RULES, batch_size=B, seq_len=T)
            jitted = build(model.init, tx, lr, at, mesh, vocab=vocab)
            program = jitted.compile_abstract((B, T + 1))
            hlo = program.as_text()
            calls = sorted(set(re.findall(r'custom_call_target="(__cudnn\$\w+)"', hlo)))
            scores = re.findall(rf"\[{B},{cfg.num_heads},{T},{T}\]", hlo)
            print(
                json.dumps(
                    {
                        "model": preset,
                        "documents": packed,
                        "cudnn_calls": calls,
                        "fused": any("Backward" in c for c in calls) and not scores,
                        "BNTT_tensors_in_hlo": len(scores),
                        "temp_MiB": program.memory_analysis().temp_size_in_bytes / 2**20,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
