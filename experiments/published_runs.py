"""The published training runs the planner is priced against (experiments/calibration.py): each
run's model sizes, devices, layout, batch, remat and published figure, with its source, as data.

`fit` rows set hardware.toml's figures (elementwise_passes: the two H100 rows; v6e's matmul
efficiency: its row); `check` rows were not used to set anything and say how far the figures
carry. This file holds the fit rows and the first checks (7B-8B runs, one 70B on v6e); the
13B-405B runs added as checks are in published_runs_at_scale.py. The published figure's unit
(`Row.unit`) is turned into seconds per step by calibration.published_step_s.
"""

import dataclasses

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
    "13b": ("gpt2", 40, 5120, 40, 40, 20480, 50368, 2048, True),
    "30b": ("gpt2", 48, 7168, 56, 56, 28672, 50368, 2048, True),
    "70b": ("gpt2", 80, 8192, 64, 64, 32768, 50368, 2048, True),
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
    # Mixture of experts: (experts, top_k, capacity factor); () dense.
    moe: tuple = ()
    # A pipelined run's schedule and virtual stages (Megatron's VP) per device.
    schedule: str = "1f1b"
    virtual_stages: int = 1
    # The TPU's weight rings; "one-way" sends what plain all-gathers send (a run that disabled
    # XLA's collective matmul).
    collective_matmul: str = "two-way"
    # The run pipelines its tensor-parallel exchanges with the GEMMs beside them (NeMo's
    # ub_tp_comm_overlap: true): what its published configuration says, priced by the hardware's
    # `tensor_overlap` (jaxdist.hardware), not a factor.
    tensor_overlap: bool = False


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
        "h100-96gb-500w",
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
