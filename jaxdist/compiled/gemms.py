"""A census of a compiled program's GEMMs by the element types they read: whether the FP8
projections really multiply FP8 operands, or fell back to 16 bits, and which matmuls read 32-bit
operands (slower than 16-bit ones on tensor cores). One more pass over the same instructions
(`analyze`) counts the rest of what decides a GPU or TPU step's speed before any device runs
it: the attention kernel, the kernels launched and host transfers inside the step.

Only the optimized program can say it. Quantize-dequantize patterns (an f8 cast and back
around a bf16 dot) are XLA's to rewrite into an f8 GEMM or not, and it does so silently either
way (jax#22313, xla#17887). Each GEMM counts once in the program's text: a layer scan's body
once, however many layers it runs (as MaxText's check counts them: 21 for Llama-2-7B's seven
projections x forward, data-gradient and weight-gradient GEMMs).

What XLA 0.11.2's GPU compiler (jax-cuda13-plugin, compiled for the H100 target config from a
CPU host) emits, for `flax.linen.fp8_ops.fp8_scaled_dot_general` forward and backward on bf16
[1024, 2048] x [2048, 4096] (and jaxdist's model steps):
- with Triton GEMMs on (XLA's default, and jaxdist's: compiled.gpu sets only the tiling cost
  model): every GEMM is a `fusion(...), kind=kCustom` whose backend_config names
  `"kind":"__triton_nested_gemm_fusion"`; the fused computation holds the `dot`, and its
  operands are that computation's parameters (or nested fusions): f8e4m3fn x f8e4m3fn for the
  forward GEMM, f8e5m2 x f8e4m3fn (data gradient) and f8e4m3fn x f8e5m2 (weight gradient), the
  scales passed in as scalar parameters and applied in the GEMM's epilogue;
- with `--xla_gpu_enable_triton_gemm=false`: `custom-call`s to `__cublas$lt$matmul$f8` with
  the same operand types (bf16 GEMMs: `__cublas$lt$matmul`); MaxText counts these;
- the quantize-dequantize pattern (flax's Fp8DotGeneralOp: `in_qdq` around a bf16 dot) becomes
  `__cublas$lt$matmul$f8` with Triton GEMMs off, but stays three bf16 Triton GEMMs with them on:
  the fallback that only counting operand types catches;
- Triton fusions of kind `"__triton"` are element-wise or reduction kernels, without a dot;
  cuDNN's fused attention is one `__cudnn$fmha*` custom call forward and one backward, each
  counted here as one GEMM kernel of its operands' type.

A GEMM's precision is its widest operand's: an f8 x bf16 dot runs as a 16-bit one.
"""

import dataclasses
import re

from jaxdist.compiled.hlo import DTYPE_BYTES, Instruction, instructions

_CALLS = re.compile(r"calls=%([\w.\-]+)")
_BACKEND_KIND = re.compile(r'"kind":"([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_EINSUM = re.compile(r"([a-z]+(?:,[a-z]+)*->[a-z]*)")
# Dots as the compiler leaves them: TPU programs write matmuls as convolutions; MoE's grouped
# matmul is a ragged dot.
_DOT_OPS = ("dot", "convolution", "ragged-dot")
# Path segments of an op_name that JAX adds (transformations, control flow), not the model.
_JAX_SEGMENTS = {"while", "body", "cond", "eval_jaxpr", "checkpoint", "remat", "closed_call"}
# The label of cuDNN's fused attention, one GEMM kernel forward and one backward.
FUSED_ATTENTION = "attention (cuDNN)"
# Data moved between host and device inside the step: offloading, callbacks, host send/recv.
_HOST_CALLS = (
    "MoveToHost",
    "MoveToDevice",
    "xla_python_gpu_callback",
    "xla_ffi_python_gpu_callback",
)


def precision_of(dtype: str) -> str:
    """An HLO element type's class: every FP8 format (e4m3, e5m2 and their variants) is f8."""
    if dtype.startswith("f8"):
        return "f8"
    return {"s8": "int8", "u8": "int8"}.get(dtype, dtype)


# Bits per element of each precision class: a GEMM runs at its widest operand's.
_BITS = {precision_of(dtype): 8 * n for dtype, n in DTYPE_BYTES.items()}


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM kernel of the program: how it runs (`kind`: cublas, triton, cudnn, or a plain
    dot the compiler left), its operands' element types, and what made it (`label`: the
    einsum or op of its metadata; `backward`: made by differentiation)."""

    name: str
    kind: str
    operands: tuple[str, ...]
    label: str
    backward: bool

    @property
    def precision(self) -> str:
        """f8, int8, bf16, f16, f32 or f64: the widest operand's class ("?" where unknown)."""
        classes = [precision_of(t) for t in self.operands]
        known = [c for c in classes if c in _BITS]
        if not known or len(known) < len(classes):
            return "?"
        return max(known, key=lambda c: _BITS[c])

    @property
    def wide(self) -> bool:
        """Whether it reads an operand wider than 16 bits (or one of a type not known)."""
        return _BITS.get(self.precision, 99) > 16


def _label(line: str) -> tuple[str, bool]:
    """(what made an instruction, whether differentiation did): the einsum of its op_name
    where it has one (models write projections as einsums), else the last segment that is the
    model's (a named scope), else the primitive."""
    m = _OP_NAME.search(line)
    if not m:
        return "", False
    path = m.group(1)
    backward = "transpose(" in path
    spec = _EINSUM.findall(path)
    if spec:
        return spec[-1], backward
    parts = path.split("/")
    named = [p for p in parts[1:-1] if re.fullmatch(r"[\w.\-]+", p) and p not in _JAX_SEGMENTS]
    return (named[-1] if named else parts[-1]), backward


def _operand_types(ins: Instruction, types: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The element types of an instruction's first two operands (a GEMM's matrices), read in
    its computation: `%t#7` is element 7 of tuple `%t`; "?" where not found."""
    line, start = ins.line, ins.operands_at
    operands = line[start : line.find(")", start) + 1]
    out = []
    for name, index in re.findall(r"%([\w.\-]+)(?:#(\d+))?", operands)[:2]:
        elements = types.get(name, ())
        i = int(index or 0)
        out.append(elements[i] if i < len(elements) else "?")
    return tuple(out)


def _fusion_kind(line: str) -> str:
    """The library a fusion's computation runs in, from its backend_config: triton for Triton
    GEMMs (any Triton fusion's dot), cudnn for cuDNN GEMM fusions, "" otherwise."""
    m = _BACKEND_KIND.search(line)
    kind = m.group(1) if m else ""
    if kind.startswith("__triton"):
        return "triton"
    if kind.startswith("__cudnn"):
        return "cudnn"
    return ""


def gemms(hlo_text: str) -> list[Gemm]:
    """Every GEMM kernel of an optimized HLO program (see the module's docstring)."""
    types: dict[str, tuple[str, ...]] = {}  # this computation's instruction -> element types
    caller_kind: dict[str, str] = {}  # fused computation -> the kind of the fusion calling it
    found: list[tuple[Gemm, str]] = []  # each GEMM, and for a dot the computation it is in
    computation = None
    for ins in instructions(hlo_text):
        if ins.computation != computation:
            computation, types = ins.computation, {}
        types[ins.name] = ins.types
        target = ins.target
        if ins.op == "fusion":
            called = _CALLS.search(ins.line)
            if called:
                caller_kind[called.group(1)] = _fusion_kind(ins.line)
        elif ins.op == "custom-call" and target.startswith(("__cublas", "__cudnn")):
            label, backward = _label(ins.line)
            if target.startswith("__cudnn$fmha"):  # q, k and v (or their gradients) first
                label, backward = FUSED_ATTENTION, "Backward" in target
            kind = "cublas" if target.startswith("__cublas") else "cudnn"
            found.append((Gemm(ins.name, kind, _operand_types(ins, types), label, backward), ""))
        elif ins.op in _DOT_OPS:
            label, backward = _label(ins.line)
            gemm = Gemm(ins.name, "dot", _operand_types(ins, types), label, backward)
            found.append((gemm, computation))
    # A dot runs in the library of the fusion that calls its computation.
    return [
        dataclasses.replace(g, kind=caller_kind.get(where) or g.kind) if where else g
        for g, where in found
    ]


def census(hlo_text: str) -> dict:
    """The GEMMs of an optimized program counted (see `counted`)."""
    return counted(gemms(hlo_text))


def counted(found: list[Gemm]) -> dict:
    """GEMMs counted by precision (`by_precision`: {"f8": 21, "bf16": 6}), by kind and
    precision (`by_kind`), the labels of those that read no FP8 (`not_f8`: label -> count),
    e.g. the head's and attention's where the projections run in FP8, the labels of those that
    read wider than 16 bits (`not_16bit`: label -> count, e.g. MoE's fp32 router), and each
    GEMM (`each`: kind, precision, operand types, label, backward)."""
    by_precision: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    not_f8: dict[str, int] = {}
    not_16bit: dict[str, int] = {}
    for g in found:
        p = g.precision
        by_precision[p] = by_precision.get(p, 0) + 1
        kind = by_kind.setdefault(g.kind, {})
        kind[p] = kind.get(p, 0) + 1
        if p != "f8":
            not_f8[g.label] = not_f8.get(g.label, 0) + 1
        if g.wide:
            not_16bit[g.label] = not_16bit.get(g.label, 0) + 1
    order = sorted(by_precision, key=lambda p: _BITS.get(p, 99))
    return {
        "by_precision": {p: by_precision[p] for p in order},
        "by_kind": by_kind,
        "not_f8": not_f8,
        "not_16bit": not_16bit,
        "each": [
            {"kind": g.kind, "precision": g.precision, "operands": list(g.operands)}
            | {"label": g.label, "backward": g.backward}
            for g in found
        ],
    }


def analyze(hlo_text: str, seq_len: int | None = None) -> dict:
    """The GEMM census (`gemms`) and, from one more pass over the same instructions, the other
    kernels (`kernels`): attention kernels (cuDNN's fused forward and backward on GPU, Pallas
    kernels on TPU), fusions and custom calls (the kernels launched, each once per loop
    iteration), host transfers, and fp32 values shaped [B, N, T, T] (attention scores, with
    T = `seq_len`), which a fused attention never makes."""
    found = gemms(hlo_text)
    fused = [g for g in found if g.label == FUSED_ATTENTION]
    attention = {
        "cudnn_fused_forward": sum(not g.backward for g in fused),
        "cudnn_fused_backward": sum(g.backward for g in fused),
    }
    return {"gemms": counted(found), "kernels": _kernels(hlo_text, seq_len, attention)}


def _kernels(hlo_text: str, seq_len: int | None, attention: dict) -> dict:
    # fp32 (XLA's attention computes its scores and softmax in fp32 whatever the compute
    # dtype) and rank 4 at least ([B, N, T, S]): with d_model = T, weights [D, D] and the saved
    # activations [L, B, T, D] of a 16-bit step are the same shape, never both.
    square = re.compile(rf"^f32\[\d+,\d+,(?:[\d,]*,)?{seq_len},{seq_len}\]") if seq_len else None
    scores = fusions = custom_calls = tpu_kernels = host = 0
    for ins in instructions(hlo_text):
        if square and square.search(ins.result):
            scores += 1
        if ins.op == "fusion":
            fusions += 1
        elif ins.op == "custom-call":
            custom_calls += 1
            tpu_kernels += ins.target == "tpu_custom_call"
            host += ins.target in _HOST_CALLS
        elif ins.op in ("send", "recv") and "is_host_transfer=true" in ins.line:
            host += 1
        elif ins.op in ("infeed", "outfeed"):
            host += 1
    return {
        "attention": attention | {"tpu_custom_calls": tpu_kernels},
        "fusions": fusions,
        "custom_calls": custom_calls,
        "host_transfers": host,
        "score_tensors": scores,
    }


def summary(counts: dict, labels: int = 4) -> str:
    """One line: "GEMMs: 21 f8, 7 bf16 (sbtd,dv->sbtv, attention (cuDNN), ...)"; the labels of
    the GEMMs that read no FP8 only where some do (what stayed 16-bit beside them)."""
    by = counts["by_precision"]
    if not by:
        return "GEMMs: none"
    line = "GEMMs: " + ", ".join(f"{n} {p}" for p, n in by.items())
    if by.get("f8") and counts["not_f8"]:
        names = list(counts["not_f8"])
        shown = ", ".join(names[:labels]) + (", ..." if len(names) > labels else "")
        line += f" (not f8: {shown})"
    return line
