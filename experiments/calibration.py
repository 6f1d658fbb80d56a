"""The planner's absolute step time beside published training runs.

    python experiments/calibration.py            # a table; about 4 s on 2 cores
    python experiments/calibration.py --json     # the rows as JSON

Each row is a run someone published with its settings: model sizes, devices, layout, batch,
remat. The planner prices that one layout (`jaxdist plan --mesh`) with the hardware preset's
calibrated figures (jaxdist/hardware.toml, jaxdist.planning.compute) and the row prints the
published step time, the predicted one and their ratio. `fit` rows set hardware.toml's figures
(matmul efficiency and its half width on H100: the two H100 rows; v6e: its row); `check` rows
were not used to set anything and say how far the figures carry.

Published figures come in three units, all turned into seconds per step:
- MaxText's TFLOP/s per device: its own FLOP count per step (`maxtext_flops_per_token`, as
  MaxText's maxtext_utils.calculate_tflops_training_per_device counted them when those runs
  were published: 6 per weight per token, plus attention's 12 L T D without causal halving)
  divided by the figure;
- llm-foundry's tokens/s per GPU: one step's tokens per GPU divided by it;
- seconds per step, as logged.
"""

import argparse
import dataclasses
import json

from jaxdist.config import StepConfig
from jaxdist.planning.inputs import PlanConfig
from jaxdist.planning.planner import plan
from meshes.presets import STANDARD_RULES
from models.inventory import plan_model
from models.presets import get_model_config
from models.remat import RECOMPUTE

MAXTEXT_A3 = "github.com/AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md"
FOUNDRY = "github.com/mosaicml/llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16"
RECIPES = "github.com/AI-Hypercomputer/tpu-recipes training/trillium/"

# Model sizes: (style, layers, d_model, heads, kv_heads, d_mlp, vocab, seq_len, tied head).
LLAMA2_7B = ("llama", 32, 4096, 32, 32, 11008, 32000, 4096, False)
LLAMA31_8B = ("llama", 32, 4096, 32, 8, 14336, 128256, 8192, False)
LLAMA31_70B = ("llama", 80, 8192, 64, 8, 28672, 128256, 8192, False)
# MPT (llm-foundry's yamls): LayerNorm, GELU MLP of 4 d_model, ALiBi, tied head, vocab 50368.
MPT = {
    "760m": ("gpt2", 24, 1536, 12, 12, 6144, 50368, 2048, True),
    "1b": ("gpt2", 24, 2048, 16, 16, 8192, 50368, 2048, True),
    "7b": ("gpt2", 32, 4096, 32, 32, 16384, 50368, 2048, True),
}
# MaxText's remat_policy "custom" with the listed tensors offloaded to the host: the rest (the
# MLP's matmuls, the attention kernel; 70B also the output projection) are recomputed.
MAXTEXT_CUSTOM = ("mlp", "attention")
MAXTEXT_CUSTOM_70B = ("mlp", "out_proj", "attention")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    role: str  # fit: sets hardware.toml's figures; check: predicted without refitting
    source: str
    sizes: tuple
    hardware: str
    layout: str
    batch_size: int  # global rows per step
    # jaxdist's policy; MaxText custom's recomputed tensors; ("half",): every other matmul
    remat: str | tuple[str, ...]
    published: float
    unit: str  # maxtext_tflops | tokens_per_s | step_s (per device)
    microbatches: int = 1


ROWS = (
    Row(
        "MaxText Llama-2-7B, 1 A3 host (8 H100), FSDP 8, seq 4096, 4 rows/GPU, remat minimal_flash",
        "fit",
        MAXTEXT_A3 + " (1x A3); settings: 1vm.sh beside it",
        LLAMA2_7B,
        "h100",
        "fsdp=8",
        32,
        "dots",
        492,
        "maxtext_tflops",
    ),
    Row(
        "llm-foundry MPT-1B, 8 H100, FSDP full shard, seq 2048, micro-batch 14, no "
        "activation checkpointing",
        "fit",
        FOUNDRY + ", row 1b 2048 8 GPUs",
        MPT["1b"],
        "h100",
        "fsdp=8",
        112,
        "none",
        45455,
        "tokens_per_s",
    ),
    Row(
        "MaxText Llama-3.1-8B, TPU v6e-8, FSDP 8, seq 8192, 196,608 tokens/step, remat custom",
        "fit",
        RECIPES + "Llama3.1-8B-MaxText/v6e-8/README.md",
        LLAMA31_8B,
        "v6e-8",
        "fsdp=8",
        24,
        MAXTEXT_CUSTOM,
        3.443,
        "step_s",
    ),
    *(
        Row(
            f"MaxText Llama-2-7B, {hosts} A3 hosts ({8 * hosts} H100), data {hosts} over "
            "the hosts x FSDP 8",
            "check",
            MAXTEXT_A3 + f" ({hosts}x A3); settings: {hosts}vm.sh beside it",
            LLAMA2_7B,
            "a3-highgpu-8g",
            f"data={hosts},fsdp=8",
            32 * hosts,
            "dots",
            tflops,
            "maxtext_tflops",
        )
        for hosts, tflops in ((2, 422), (4, 407), (8, 409), (16, 375))
    ),
    Row(
        "llm-foundry MPT-7B, 8 H100, seq 2048, micro-batch 6, no activation checkpointing",
        "check",
        FOUNDRY + ", row 7b 2048 8 GPUs",
        MPT["7b"],
        "h100",
        "fsdp=8",
        48,
        "none",
        10643,
        "tokens_per_s",
    ),
    Row(
        "llm-foundry MPT-7B, 8 H100, seq 4096, micro-batch 16 x 2 accumulated, activation "
        "checkpointing (full recompute)",
        "check",
        FOUNDRY + ", row 7b 4096 8 GPUs",
        MPT["7b"][:7] + (4096, True),
        "h100",
        "fsdp=8",
        256,
        "full",
        8611,
        "tokens_per_s",
        microbatches=2,
    ),
    Row(
        "llm-foundry MPT-760M, 16 H100 (2 hosts), seq 2048, micro-batch 24",
        "check",
        FOUNDRY + ", row 760m 2048 16 GPUs",
        MPT["760m"],
        "h100",
        "fsdp=16",
        384,
        "none",
        68551,
        "tokens_per_s",
    ),
    Row(
        "torchtitan Llama-3.1-8B, 8 H100 (96 GB, capped at 500 W), FSDP 8, seq 8192, 2 rows/GPU, "
        "torch.compile, selective op checkpointing (every other matmul recomputed)",
        "check",
        "github.com/pytorch/torchtitan docs/performance.md, Table 1",
        LLAMA31_8B,
        "h100",
        "fsdp=8",
        16,
        ("half",),
        6667,
        "tokens_per_s",
    ),
    Row(
        "MaxText Llama-3.1-70B, TPU v6e-256, FSDP 256, seq 8192, 4 rows/chip, remat custom",
        "check",
        # Its log line's total_weights, 8,388,608 tokens, is 4 rows per chip (the workload
        # listed beside it says 5): the step it times is the one priced.
        RECIPES + "Llama3.1-70B-MaxText/README.md, its logged step",
        LLAMA31_70B,
        "v6e-256",
        "fsdp=256",
        1024,
        MAXTEXT_CUSTOM_70B,
        34.562,
        "step_s",
    ),
)


def model_config(sizes: tuple, remat: str | tuple[str, ...]):
    """jaxdist's model of these sizes, with the run's remat policy or, for MaxText's custom
    one, the nearest (memory only: its time is priced by `recompute`)."""
    style, layers, d, heads, kv, mlp, vocab, seq, tied = sizes
    return get_model_config(
        "custom",
        style=style,
        num_layers=layers,
        d_model=d,
        num_heads=heads,
        num_kv_heads=kv,
        d_mlp=mlp,
        vocab_size=vocab,
        seq_len=seq,
        tie_embeddings=tied,
        compute_dtype="bfloat16",
        remat=remat if isinstance(remat, str) else "dots_except_mlp",
    )


def recompute(row: Row, config) -> tuple[float, bool]:
    """(share of each layer's forward matmul FLOPs rerun, attention's forward rerun): from
    models/remat.py for jaxdist's policies, counted here for MaxText's custom tensors."""
    if isinstance(row.remat, str):
        return RECOMPUTE[row.remat](config), row.remat == "full"
    D, F, N, G = config.d_model, config.d_mlp, config.num_heads, config.num_kv_heads
    H = config.head_dim
    parts = {"mlp": 3 * D * F, "qkv_proj": D * (N + 2 * G) * H, "out_proj": N * H * D}
    if row.remat == ("half",):  # torchtitan's selective op policy: every other matmul rerun
        return 0.5, False
    share = sum(parts.get(p, 0) for p in row.remat) / sum(parts.values())
    return share, "attention" in row.remat


def maxtext_flops_per_token(sizes: tuple) -> float:
    """MaxText's count (maxtext_utils.calculate_tflops_training_per_device, 2024-25): the
    MLP's three matmuls, QKV, the output projection and the head, 2 FLOPs per weight, times 3
    for forward and backward; attention 4 T H d_head per layer, times 3, not halved."""
    _, layers, d, heads, kv, mlp, vocab, seq, _ = sizes
    head_dim = d // heads
    ffn = 2 * mlp * d * 3
    qkv = 2 * d * (heads + 2 * kv) * head_dim
    projection = 2 * d * heads * head_dim
    learnable = ((ffn + qkv + projection) * layers + 2 * d * vocab) * 3
    attention = 4 * seq * heads * head_dim * layers * 3
    return learnable + attention


def published_step_s(row: Row, devices: int) -> float:
    tokens_per_device = row.batch_size * row.sizes[7] / devices
    if row.unit == "maxtext_tflops":
        return maxtext_flops_per_token(row.sizes) * tokens_per_device / (row.published * 1e12)
    if row.unit == "tokens_per_s":
        return tokens_per_device / row.published
    return row.published


def predict(row: Row) -> dict:
    """The planner's row for the published layout."""
    layout = tuple((a, int(n)) for a, n in (p.split("=") for p in row.layout.split(",")))
    devices = 1
    for _, n in layout:
        devices *= n
    config = model_config(row.sizes, row.remat)
    share, attention = recompute(row, config)
    model = dataclasses.replace(
        plan_model(config), recompute_matmul=share, recompute_attention=attention
    )
    cfg = PlanConfig(
        devices=devices,
        hardware=row.hardware,
        batch_size=row.batch_size,
        # The published TPU runs compiled with XLA's own windowed einsums, two-way rings.
        step=StepConfig(microbatches=row.microbatches, collective_matmul="two-way"),
        mesh=layout,
    )
    priced = plan(model, STANDARD_RULES, cfg)["layouts"][0]
    published = published_step_s(row, devices)
    return {
        "name": row.name,
        "role": row.role,
        "source": row.source,
        "published_step_s": published,
        "predicted_step_s": priced["step_s"],
        "ratio": priced["step_s"] / published,
        "predicted_mfu": priced["mfu"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [predict(row) for row in ROWS]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{'role':5} {'published s':>11} {'predicted s':>11} {'ratio':>6}  run (source)")
    for r in results:
        print(
            f"{r['role']:5} {r['published_step_s']:11.3f} {r['predicted_step_s']:11.3f} "
            f"{r['ratio']:6.3f}  {r['name']} ({r['source']})"
        )


if __name__ == "__main__":
    main()
