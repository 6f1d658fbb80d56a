"""Published runs at 13B-405B scale, added as checks (none refitted): NVIDIA's DGX Cloud
benchmarks (MaxText and NeMo on H100), llm-foundry's larger MPT runs, torchtitan's 405B and A100
runs, and tpu-recipes' v6e and v5p runs; each with its settings and source, as data (the rows'
fields: published_runs.Row). experiments/calibration.py prices them after published_runs.ROWS.
"""

from published_runs import (
    FOUNDRY,
    LLAMA31_70B,
    MAXTEXT_CUSTOM,
    MAXTEXT_CUSTOM_70B,
    MPT,
    Row,
)

RECIPES_C = "github.com/AI-Hypercomputer/tpu-recipes@c8cfe2f6 training/"
DGXC = "github.com/NVIDIA/dgxc-benchmarking"
DGXC_2411 = DGXC + "@35a9aec (v24.11.1) "
DGXC_2504 = DGXC + "@741c886 (v25.04) "
TITAN_2408 = "github.com/pytorch/torchtitan@3faaa1a0 docs/performance.md"

# Model sizes: (style, layers, d_model, heads, kv_heads, d_mlp, vocab, seq_len, tied head).
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
# MaxText's remat custom (published_runs.MAXTEXT_CUSTOM) with only decoder_layer_input
# offloaded: every tensor of the layer recomputed.
MAXTEXT_CUSTOM_ALL = ("mlp", "qkv_proj", "out_proj", "attention")
# Custom with context (attention's output) and mlpwo offloaded (v5p 405B): the projections,
# the MLP's gate and up (mlp_in) and, for its softmax statistics, the attention kernel rerun.
MAXTEXT_CUSTOM_405B_V5P = ("mlp_in", "qkv_proj", "out_proj", "attention")
# Custom with q, k, v, out_proj and mlpwo kept on the device (dgxc's MaxText Llama2-70B bf16):
# the MLP's gate and up and attention recomputed.
MAXTEXT_CUSTOM_MLPWI = ("mlp_in", "attention")


def _dgxc_maxtext(release: str, name: str, seq: int, remat_text: str, model, remat, runs):
    """A DGX Cloud benchmark's MaxText rows on H100 (2 rows a GPU), one per (GPUs, layout,
    published seconds a step) of its README's BF16 table."""
    return tuple(
        Row(
            f"MaxText {name}, {n} H100, {layout.replace(',', ' x ')}, seq {seq}, 2 rows/GPU, "
            f"remat {remat_text}",
            "check",
            release + f"maxtext/README_70b.md, BF16 table, {n}x H100; maxtext/configure.sh",
            model,
            "h100",
            layout,
            2 * n,
            remat,
            step_s,
            "step_s",
        )
        for n, layout, step_s in runs
    )


ROWS = (
    # NVIDIA DGX Cloud benchmarks (H100 SXM, 8 per host, InfiniBand 400 Gb/s per GPU), MaxText
    # Llama2-70B bf16: maxtext/README_70b.md's table, settings maxtext/configure.sh (MBS 2,
    # seq 4096, FSDP over every GPU up to 256, FSDP 128 x DP beyond; remat custom with q, k,
    # v, out_proj and mlpwo on the device).
    *_dgxc_maxtext(
        DGXC_2411,
        "Llama2-70B",
        4096,
        "custom (MLP gate/up and attention recomputed)",
        LLAMA2_70B,
        MAXTEXT_CUSTOM_MLPWI,
        (
            (64, "fsdp=64", 6.999),
            (128, "fsdp=128", 7.072),
            (256, "fsdp=256", 7.153),
            (512, "data=4,fsdp=128", 7.091),
            (1024, "data=8,fsdp=128", 7.084),
            (2048, "data=16,fsdp=128", 7.066),
        ),
    ),
    # The same benchmarks, MaxText Llama3-70B bf16 (v25.04: MBS 2, seq 8192, remat
    # save_qkv_proj: out_proj, MLP and attention recomputed; the README's layout table).
    *_dgxc_maxtext(
        DGXC_2504,
        "Llama3-70B",
        8192,
        "save_qkv_proj",
        LLAMA31_70B,
        MAXTEXT_CUSTOM_70B,
        (
            (128, "fsdp=128", 15.563),
            (256, "fsdp=256", 15.444),
            (512, "data=4,fsdp=128", 15.519),
            (1024, "data=8,fsdp=128", 15.603),
            (2048, "data=16,fsdp=128", 15.898),
        ),
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
