"""What a compiled GPU or TPU program runs, read from its optimized HLO text: the attention
kernel, the matmuls whose operands are not 16-bit, the kernels launched, and host transfers
inside the step; and the warnings a slow or oversized step deserves.

The compile-only report (jaxdist.compiled.aot) adds these for accelerator targets: most of
what decides a GPU step's speed is visible in the program before any GPU runs it.
"""

import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_INSTR = re.compile(
    r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+([\w\-]+)\("
)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OPERANDS = re.compile(r"\(([^)]*)\)")
# Library matmuls: cuBLAS calls, also when XLA picks them over its own (Triton) GEMMs.
_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
# Data moved between host and device inside the step: offloading, callbacks, host send/recv.
_HOST_CALLS = (
    "MoveToHost",
    "MoveToDevice",
    "xla_python_gpu_callback",
    "xla_ffi_python_gpu_callback",
)
_SIXTEEN_BIT = ("bf16", "f16", "f8e4m3fn", "f8e5m2", "s8", "u8")


def _dtype(shape: str) -> str:
    return shape.split("[", 1)[0] if not shape.startswith("(") else "tuple"


def analyze(hlo_text: str, seq_len: int | None = None) -> dict:
    """Counts over the optimized program: attention kernels (cuDNN's fused forward and
    backward on GPU, Pallas kernels on TPU), dots by operand dtype (TPU programs write them as
    convolutions), fusions and custom calls (the kernels launched, each once per loop
    iteration), host transfers, and fp32 values shaped [B, N, T, T] (attention scores, with
    T = `seq_len`), which a fused attention never makes."""
    types: dict[str, str] = {}  # this computation's instruction -> dtype
    # fp32 (XLA's attention computes its scores and softmax in fp32 whatever the compute
    # dtype) and rank 4 at least ([B, N, T, S]): with d_model = T, weights [D, D] and the saved
    # activations [L, B, T, D] of a 16-bit step are the same shape, never both.
    square = re.compile(rf"^f32\[\d+,\d+,(?:[\d,]*,)?{seq_len},{seq_len}\]") if seq_len else None
    scores = 0
    fusions = custom_calls = 0
    cudnn_fwd = cudnn_bwd = tpu_kernels = host = 0
    dots: dict[str, int] = {}
    wide: list[str] = []
    for line in hlo_text.splitlines():
        if _COMPUTATION.match(line) and line.rstrip().endswith("{"):
            types = {}
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        types[name] = _dtype(shape)
        if square and square.search(shape):
            scores += 1
        target = _TARGET.search(line)
        target = target.group(1) if target else ""
        if op == "fusion":
            fusions += 1
        elif op == "custom-call":
            custom_calls += 1
            if target.startswith("__cudnn$fmha"):
                if "Backward" in target:
                    cudnn_bwd += 1
                else:
                    cudnn_fwd += 1
            if target == "tpu_custom_call":
                tpu_kernels += 1
            if target in _HOST_CALLS:
                host += 1
        elif op in ("send", "recv") and "is_host_transfer=true" in line:
            host += 1
        elif op in ("infeed", "outfeed"):
            host += 1
        if op in ("dot", "convolution") or target in _GEMM_CALLS:
            after = line[m.end() - 1 :]
            operands = _OPERANDS.match(after)
            names = [o.strip().lstrip("%") for o in operands.group(1).split(",")][:2]
            kinds = sorted({types.get(n, "?") for n in names})
            key = "x".join(kinds)
            dots[key] = dots.get(key, 0) + 1
            if any(k not in _SIXTEEN_BIT for k in kinds):
                meta = re.search(r'op_name="([^"]+)"', line)
                wide.append(f"{key}: {meta.group(1) if meta else name}")
    return {
        "attention": {
            "cudnn_fused_forward": cudnn_fwd,
            "cudnn_fused_backward": cudnn_bwd,
            "tpu_custom_calls": tpu_kernels,
        },
        "dots_by_operand_dtype": dots,
        "dots_not_16bit": len(wide),
        "dots_not_16bit_ops": wide,
        "fusions": fusions,
        "custom_calls": custom_calls,
        "host_transfers": host,
        "score_tensors": scores,
    }


def attention_kernel(kernels: dict, platform: str, attention: str | None) -> str:
    """The attention the program runs, in words."""
    a = kernels["attention"]
    if platform == "gpu":
        if a["cudnn_fused_forward"] and a["cudnn_fused_backward"]:
            return "cudnn fused (forward and backward)"
        if a["cudnn_fused_forward"]:
            return "cudnn fused forward, XLA backward"
        return "xla (fallback: T x T scores in memory)"
    if platform == "tpu":
        if attention == "splash" and a["tpu_custom_calls"]:
            return "splash (Pallas kernel)"
        return "xla (T x T scores in memory)"
    return "xla"


def warnings(report: dict, memory_bytes: float) -> list[str]:
    """What would make the step slow or fail on the target, one line each."""
    out = []
    k = report["kernels"]
    if not report["attention_kernel"].startswith(("cudnn fused (", "splash")):
        out.append(f"attention is not fused: {report['attention_kernel']}")
    if k["dots_not_16bit"]:
        out.append(
            f"{k['dots_not_16bit']} matmuls with 32-bit operands (slower than bf16 on tensor "
            "cores): see kernels.dots_not_16bit_ops"
        )
    if k["host_transfers"]:
        out.append(f"{k['host_transfers']} host transfers inside the step")
    peak = report["per_device_bytes"]["peak_estimate"]
    if peak > memory_bytes:
        out.append(
            f"peak {peak / 2**30:.1f} GiB per device is over the "
            f"{memory_bytes / 2**30:.1f} GiB a program may hold on the device"
        )
    return out
