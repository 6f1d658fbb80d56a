"""The planner's absolute step time beside published training runs.

    python experiments/calibration.py            # a table; about 15 s on 2 cores
    python experiments/calibration.py --json     # the rows as JSON, with each row's terms

Each row is a run someone published with its settings: model sizes, devices, layout, batch,
remat. The planner prices that one layout (planning.planner.price, what `jaxdist plan --mesh`
runs) with the hardware preset's calibrated figures (jaxdist/hardware.toml,
jaxdist.planning.compute), its tensor-parallel exchanges overlappable where the run's
published configuration pipelines them with its GEMMs (`Row.tensor_overlap`), and the row
prints the published step time, the predicted one and their ratio. `fit` rows set
hardware.toml's figures (elementwise_passes: the two H100 rows; v6e's matmul efficiency: its
row); `check` rows were not used to set anything and say how far the figures carry.

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
from jaxdist.hardware import get_hardware
from jaxdist.planning.inputs import PlanConfig
from jaxdist.planning.planner import price
from meshes.presets import STANDARD_RULES
from models.inventory import plan_model
from models.presets import get_model_config
from models.remat import RECOMPUTE

MAXTEXT_A3 = "github.com/AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md"
FOUNDRY = "github.com/mosaicml/llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16"
RECIPES = "github.com/AI-Hypercomputer/tpu-recipes training/trillium/"
RECIPES_C = "github.com/AI-Hypercomputer/tpu-recipes@c8cfe2f6 training/"
DGXC = "github.com/NVIDIA/dgxc-benchmarking"
DGXC_2411 = DGXC + "@35a9aec (v24.11.1) "
DGXC_2504 = DGXC + "@741c886 (v25.04) "
TITAN_2408 = "github.com/pytorch/torchtitan@3faaa1a0 docs/performance.md"

# Model sizes: (style, layers, d_model, heads, kv_heads, d_mlp, vocab, seq_len, tied head).
LLAMA2_7B = ("llama", 32, 4096, 32, 32, 11008, 32000, 4096, False)
LLAMA31_8B = ("llama", 32, 4096, 32, 8, 14336, 128256, 8192, False)
LLAMA31_70B = ("llama", 80, 8192, 64, 8, 28672, 128256, 8192, False)
LLAMA2_13B = ("llama", 40, 5120, 40, 40, 13824, 32000, 4096, False)
LLAMA2_70B = ("llama", 80, 8192, 64, 8, 28672, 32000, 4096, False)
LLAMA31_405B = ("llama", 126, 16384, 128, 8, 53248, 128256, 8192, False)
# NeMo's llama3.1_405b.yaml (dgxc-benchmarking v24.11.1) as it ran: 16 query groups.
LLAMA31_405B_NEMO = LLAMA31_405B[:4] + (16,) + LLAMA31_405B[5:]
# MaxText's gpt3-175b.yml: learned positions, LayerNorm, GELU MLP of 4 d_model, tied head.
GPT3_175B = ("gpt2", 96, 12288, 96, 96, 49152, 50304, 2048, True)
# NeMo's gpt3_175b_hydra.yaml: the same, its GPT-2 BPE vocabulary (50257) padded by Megatron
# to a multiple of 128 x TP 4.
GPT3_175B_NEMO = GPT3_175B[:6] + (50688,) + GPT3_175B[7:]
# MaxText's mixtral-8x7b.yml / mixtral-8x22b.yml: every layer's MLP 8 SwiGLU experts, top 2.
MIXTRAL_8X7B = ("llama", 32, 4096, 32, 8, 14336, 32000, 4096, False)
MIXTRAL_8X22B = ("llama", 56, 6144, 48, 8, 16384, 32768, 4096, False)
# MaxText's dropping MoE ("megablox": False, "sparse_matmul": False), capacity factor 1.25.
MIXTRAL_DROPPED = (8, 2, 1.25)
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
# Custom with only decoder_layer_input offloaded: every tensor of the layer recomputed.
MAXTEXT_CUSTOM_ALL = ("mlp", "qkv_proj", "out_proj", "attention")
# Custom with context (attention's output) and mlpwo offloaded (v5p 405B): the projections,
# the MLP's gate and up (mlp_in) and, for its softmax statistics, the attention kernel rerun.
MAXTEXT_CUSTOM_405B_V5P = ("mlp_in", "qkv_proj", "out_proj", "attention")
# Custom with q, k, v, out_proj and mlpwo kept on the device (dgxc's MaxText Llama2-70B bf16):
# the MLP's gate and up and attention recomputed.
MAXTEXT_CUSTOM_MLPWI = ("mlp_in", "attention")


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
    # --- Published runs at 13B-405B scale, added as checks (none refitted) ---
    # NVIDIA DGX Cloud benchmarks (H100 SXM, 8 per host, InfiniBand 400 Gb/s per GPU), MaxText
    # Llama2-70B bf16: maxtext/README_70b.md's table, settings maxtext/configure.sh (MBS 2,
    # seq 4096, FSDP over every GPU up to 256, FSDP 128 x DP beyond; remat custom with q, k,
    # v, out_proj and mlpwo on the device).
    *(
        Row(
            f"MaxText Llama2-70B, {n} H100, {layout.replace(',', ' x ')}, seq 4096, 2 rows/GPU, "
            "remat custom (MLP gate/up and attention recomputed)",
            "check",
            DGXC_2411 + f"maxtext/README_70b.md, BF16 table, {n}x H100; maxtext/configure.sh",
            LLAMA2_70B,
            "h100",
            layout,
            2 * n,
            MAXTEXT_CUSTOM_MLPWI,
            step_s,
            "step_s",
        )
        for n, layout, step_s in (
            (64, "fsdp=64", 6.999),
            (128, "fsdp=128", 7.072),
            (256, "fsdp=256", 7.153),
            (512, "data=4,fsdp=128", 7.091),
            (1024, "data=8,fsdp=128", 7.084),
            (2048, "data=16,fsdp=128", 7.066),
        )
    ),
    # The same benchmarks, MaxText Llama3-70B bf16 (v25.04: MBS 2, seq 8192, remat
    # save_qkv_proj: out_proj, MLP and attention recomputed; the README's layout table).
    *(
        Row(
            f"MaxText Llama3-70B, {n} H100, {layout.replace(',', ' x ')}, seq 8192, 2 rows/GPU, "
            "remat save_qkv_proj",
            "check",
            DGXC_2504 + f"maxtext/README_70b.md, BF16 table, {n}x H100; maxtext/configure.sh",
            LLAMA31_70B,
            "h100",
            layout,
            2 * n,
            MAXTEXT_CUSTOM_70B,
            step_s,
            "step_s",
        )
        for n, layout, step_s in (
            (128, "fsdp=128", 15.563),
            (256, "fsdp=256", 15.444),
            (512, "data=4,fsdp=128", 15.519),
            (1024, "data=8,fsdp=128", 15.603),
            (2048, "data=16,fsdp=128", 15.898),
        )
    ),
    # The same benchmarks, NeMo 24.09 Llama 3.1 70B bf16: TP 4, PP 4, CP 2, VP 5, MBS 1, GA 64,
    # seq 8192, no activation checkpointing, sequence parallel, TP and P2P comm overlap
    # (llama3.1/llama3.1_70b.yaml: ub_tp_comm_overlap, its ub_tp_comm_overlap_cfg pairing every
    # layer's all-gather and reduce-scatter with a GEMM, forward and backward). DP = GPUs / 32;
    # 64 microbatches per step.
    *(
        Row(
            f"NeMo Llama3.1-70B, {n} H100, TP 4 x PP 4 (VP 5) x CP 2 x DP {n // 32}, seq 8192, "
            "MBS 1 x 64, no checkpointing",
            "check",
            DGXC_2411 + f"llama3.1/README_70b.md, BF16 table, {n}x H100; llama3.1_70b.yaml",
            LLAMA31_70B,
            "h100",
            f"pipeline=4,data={n // 32},context=2,tensor=4",
            2 * n,
            "none",
            step_s,
            "step_s",
            microbatches=64,
            schedule="interleaved",
            virtual_stages=5,
            tensor_overlap=True,
        )
        for n, step_s in ((64, 14.72), (256, 14.8), (2048, 14.98))
    ),
    # NeMo 24.09 Llama 3.1 405B bf16: TP 8, PP 9, CP 2, VP 7, MBS 1, GA 63, seq 8192 (its
    # yaml: 16 query groups), no activation checkpointing, sequence parallel, TP comm overlap as
    # the 70B's (ub_tp_comm_overlap). DP = GPUs / 144.
    *(
        Row(
            f"NeMo Llama3.1-405B, {n} H100, TP 8 x PP 9 (VP 7) x CP 2 x DP {n // 144}, seq 8192, "
            "MBS 1 x 63, no checkpointing",
            "check",
            DGXC_2411 + f"llama3.1/README_405b.md, BF16 table, {n}x H100; llama3.1_405b.yaml",
            LLAMA31_405B_NEMO,
            "h100",
            f"pipeline=9,data={n // 144},context=2,tensor=8",
            n * 63 // 144,
            "none",
            step_s,
            "step_s",
            microbatches=63,
            schedule="interleaved",
            virtual_stages=7,
            tensor_overlap=True,
        )
        for n, step_s in ((576, 17.20), (2304, 17.62))
    ),
    # NeMo Megatron 24.11 GPT-3 175B bf16: TP 4, PP 8, VP 12, MBS 1, seq 2048, no activation
    # checkpointing, sequence parallel, TP comm overlap (nemo_megatron/gpt3_175b_hydra.yaml:
    # ub_tp_comm_overlap). DP = GPUs / 32; 64 microbatches.
    *(
        Row(
            f"NeMo GPT-3 175B, {n} H100, TP 4 x PP 8 (VP 12) x DP {n // 32}, seq 2048, MBS 1 x 64",
            "check",
            DGXC_2411 + f"nemo_megatron/README_175b.md, BF16 table, {n}x H100",
            GPT3_175B_NEMO,
            "h100",
            f"pipeline=8,data={n // 32},tensor=4",
            2 * n,
            "none",
            step_s,
            "step_s",
            microbatches=64,
            schedule="interleaved",
            virtual_stages=12,
            tensor_overlap=True,
        )
        for n, step_s in ((128, 8.91), (2048, 9.02))
    ),
    # llm-foundry MPT-13B/30B/70B on H100 80GB, FSDP full shard, seq 2048, activation
    # checkpointing (full), bf16: the benchmarking README's tables.
    *(
        Row(
            f"llm-foundry MPT-{size.upper()}, {n} H100, FSDP {n}, seq 2048, micro-batch {mb}"
            + (f" x {ga} accumulated" if ga > 1 else "")
            + ", activation checkpointing (full recompute)",
            "check",
            FOUNDRY + f", row {size} 2048 {n} GPUs",
            MPT[size],
            "h100",
            f"fsdp={n}",
            mb * ga * n,
            "full",
            tps,
            "tokens_per_s",
            microbatches=ga,
        )
        for size, n, mb, ga, tps in (
            ("13b", 128, 16, 1, 5080),
            ("13b", 512, 16, 1, 4952),
            ("30b", 16, 10, 3, 2263),
            ("30b", 128, 8, 1, 2199),
            ("30b", 512, 8, 1, 2115),
            ("70b", 64, 8, 4, 1039),
            ("70b", 128, 8, 1, 1058),
            ("70b", 512, 8, 1, 1007),
        )
    ),
    # torchtitan, Aug 2024: Llama 3.1 405B on 128 H100 (94-96 GB, lower TDP), FSDP 16 x TP 8,
    # local batch 2, seq 8192, full activation checkpointing, bf16: 109 tokens/s per GPU. The
    # same Grand Teton hosts as its 8B row (hardware.toml's h100-96gb-500w).
    Row(
        "torchtitan Llama3.1-405B, 128 H100 (lower TDP), FSDP 16 x TP 8, seq 8192, 2 rows per "
        "FSDP rank, full activation checkpointing",
        "check",
        TITAN_2408 + ", Llama 3.1 performance numbers, 405B bf16 row",
        LLAMA31_405B,
        "h100-96gb-500w",
        "fsdp=16,tensor=8",
        32,
        "full",
        109,
        "tokens_per_s",
    ),
    # torchtitan, Aug 2024, 64 A100 80GB, FSDP 64: Llama 3 70B (seq 8192, local batch 1, full
    # AC: 331 tokens/s/GPU), Llama 2 70B (seq 4096, local batch 2, full AC: 353), Llama 2 13B
    # (seq 4096, local batch 2, no AC: 2162).
    *(
        Row(
            f"torchtitan {name}, 64 A100 80GB, FSDP 64, {rows} rows/GPU, {ac}",
            "check",
            TITAN_2408 + f", {name} row",
            sizes,
            "a100",
            "fsdp=64",
            64 * rows,
            remat,
            tps,
            "tokens_per_s",
        )
        for name, sizes, rows, remat, ac, tps in (
            ("Llama3-70B", LLAMA31_70B, 1, "full", "full AC", 331),
            ("Llama2-70B", LLAMA2_70B, 2, "full", "full AC", 353),
            ("Llama2-13B", LLAMA2_13B, 2, "none", "no AC", 2162),
        )
    ),
    # tpu-recipes (Trillium, v6e): each README's logged step. total_weights gives the tokens.
    *(
        Row(
            f"MaxText Llama3.1-70B, TPU {hw}, FSDP {n}, seq 8192, {rows} rows/chip, remat custom"
            + (", collective matmul disabled" if cm == "one-way" else ""),
            "check",
            RECIPES_C + f"trillium/Llama3.1-70B-MaxText/{hw}/README.md, its logged step",
            LLAMA31_70B,
            hw,
            f"fsdp={n}",
            rows * n,
            MAXTEXT_CUSTOM_70B,
            step_s,
            "step_s",
            collective_matmul=cm,
        )
        for hw, n, rows, step_s, cm in (
            ("v6e-32", 32, 2, 17.790, "one-way"),
            ("v6e-64", 64, 2, 18.688, "two-way"),
            ("v6e-128", 128, 4, 34.786, "two-way"),
            ("v6e-256", 256, 5, 42.656, "two-way"),
        )
    ),
    Row(
        # Its log's total_weights, 2,097,152 tokens, is 2 rows per chip (the workload lists 3).
        "MaxText Llama2-70B, TPU v6e-256, FSDP 256 (fsdp_transpose), seq 4096, 2 rows/chip, "
        "remat qkv_proj_offloaded",
        "check",
        RECIPES_C + "trillium/Llama2-70B-MaxText/README.md, its logged step",
        LLAMA2_70B,
        "v6e-256",
        "fsdp=256",
        512,
        MAXTEXT_CUSTOM_70B,
        9.052,
        "step_s",
    ),
    Row(
        "MaxText GPT-3 175B, TPU v6e-256, FSDP 256, seq 2048, 3 rows/chip, remat full",
        "check",
        RECIPES_C + "trillium/GPT3-175B-MaxText/bf16/README.md, its logged step",
        GPT3_175B,
        "v6e-256",
        "fsdp=256",
        768,
        "full",
        17.182,
        "step_s",
    ),
    Row(
        "MaxText Llama3.1-405B, TPU 2 x v6e-256 over DCN, FSDP 512, seq 8192, 1 row/chip, "
        "remat custom (only the layer input offloaded: all recomputed)",
        "check",
        RECIPES_C + "trillium/Llama3.1-405B-MaxText/README.md, its logged step",
        LLAMA31_405B,
        "v6e-256",
        "fsdp=512",
        512,
        MAXTEXT_CUSTOM_ALL,
        54.803,
        "step_s",
    ),
    Row(
        "MaxText Mixtral-8x7B, TPU v6e-256, FSDP 256, seq 4096, 12 rows/chip, dropping MoE "
        "(capacity 1.25), remat custom (MLP and attention recomputed)",
        "check",
        RECIPES_C + "trillium/Mixtral-8x7B-MaxText/README.md, its logged step",
        MIXTRAL_8X7B,
        "v6e-256",
        "fsdp=256",
        3072,
        MAXTEXT_CUSTOM,
        13.484,
        "step_s",
        moe=MIXTRAL_DROPPED,
    ),
    Row(
        "MaxText Mixtral-8x22B, TPU v6e-256, FSDP 64 x expert 4, seq 4096, 8 rows/chip, "
        "dropping MoE (capacity 1.25), remat custom (MLP and attention recomputed)",
        "check",
        RECIPES_C + "trillium/Mixtral-8x22B-MaxText/README.md, its logged step; settings: "
        "maxtext@449b4fe5 benchmarks/maxtext_trillium_model_configs.py mixtral_8x22b_dropped",
        MIXTRAL_8X22B,
        "v6e-256",
        "fsdp=64,expert=4",
        2048,
        MAXTEXT_CUSTOM,
        24.706,
        "step_s",
        moe=MIXTRAL_DROPPED,
    ),
    Row(
        "MaxText Llama3.1-405B, TPU v5p-1024 (512 chips), FSDP 512, seq 8192, 2 rows/chip, "
        "remat custom (context and mlpwo offloaded)",
        "check",
        RECIPES_C + "v5p/Llama3.1-405B-MaxText/README.md, its logged step; settings: "
        "maxtext@3eb77db3 benchmarks/maxtext_v5p_model_configs.py llama3_1_405b_8192_v5p_1024",
        LLAMA31_405B,
        "v5p-1024",
        "fsdp=512",
        1024,
        MAXTEXT_CUSTOM_405B_V5P,
        131.474,
        "step_s",
    ),
)


def model_config(sizes: tuple, remat: str | tuple[str, ...], moe: tuple = ()):
    """jaxdist's model of these sizes, with the run's remat policy or, for MaxText's custom
    one, the nearest (memory only: its time is priced by `recompute`); `moe`: (experts,
    top_k, capacity factor), every layer's MLP one of experts of width d_mlp."""
    style, layers, d, heads, kv, mlp, vocab, seq, tied = sizes
    experts = {}
    if moe:
        experts = dict(num_experts=moe[0], top_k=moe[1], capacity_factor=moe[2])
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
        **experts,
    )


def recompute(row: Row, config) -> tuple[float, bool]:
    """(share of each layer's forward matmul FLOPs rerun, attention's forward rerun): from
    models/remat.py for jaxdist's policies, counted here for MaxText's custom tensors."""
    if isinstance(row.remat, str):
        return RECOMPUTE[row.remat](config), row.remat == "full"
    D, F, N, G = config.d_model, config.d_mlp, config.num_heads, config.num_kv_heads
    H = config.head_dim
    k = config.top_k if config.num_experts else 1  # a token's experts
    gated = 3 if config.style == "llama" else 2
    parts = {"mlp": gated * D * F * k, "qkv_proj": D * (N + 2 * G) * H, "out_proj": N * H * D}
    if row.remat == ("half",):  # torchtitan's selective op policy: every other matmul rerun
        return 0.5, False
    # mlp_in: the MLP's input projections alone (gate and up), its output one kept.
    rerun = dict(parts, mlp_in=(gated - 1) * D * F * k)
    share = sum(rerun.get(p, 0) for p in row.remat) / sum(parts.values())
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


# The planner's terms each row reports beside its step time (--json), and compute by kind.
TERMS = ("compute_s", "bubble_s", "comm_s", "comm_exposed_s", "overlap_s", "sync_s")


def predict(row: Row) -> dict:
    """The planner's row for the published layout."""
    layout = tuple((a, int(n)) for a, n in (p.split("=") for p in row.layout.split(",")))
    devices = 1
    for _, n in layout:
        devices *= n
    config = model_config(row.sizes, row.remat, row.moe)
    share, attention = recompute(row, config)
    model = dataclasses.replace(
        plan_model(config), recompute_matmul=share, recompute_attention=attention
    )
    hw = dataclasses.replace(get_hardware(row.hardware), tensor_overlap=row.tensor_overlap)
    cfg = PlanConfig(
        devices=devices,
        hardware=row.hardware,
        batch_size=row.batch_size,
        step=StepConfig(
            microbatches=row.microbatches,
            pipeline_schedule=row.schedule,
            virtual_stages=row.virtual_stages,
            # The published TPU runs compiled with XLA's own windowed einsums, two-way rings.
            collective_matmul=row.collective_matmul,
        ),
        mesh=layout,
    )
    priced = price(dict(layout), [model], STANDARD_RULES, cfg, hw)
    published = published_step_s(row, devices)
    return {
        "name": row.name,
        "role": row.role,
        "source": row.source,
        "published_step_s": published,
        "predicted_step_s": priced["step_s"],
        "ratio": priced["step_s"] / published,
        "predicted_mfu": priced["mfu"],
        "terms": {k: priced[k] for k in TERMS} | {"compute_by_kind": priced["compute_by_kind"]},
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
