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

import numpy as np

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
    """One GEMM kernel of the program: how it runs (`kind`: cublas, triton, cudnn, pallas (the
    experts' Mosaic GPU grouped GEMMs), or a plain dot the compiler left), its operands'
    element types, and what made it (`label`: the einsum or op of its metadata; `backward`:
    made by differentiation)."""

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
        elif ins.op == "custom-call" and target.startswith("mosaic_gpu"):
            if "grouped_gemm" in _op_name(ins.line):  # the experts' (jaxdist.kernels)
                backward = "transpose(" in _op_name(ins.line) or "wgrad" in _op_name(ins.line)
                constraints = _OPERAND_SHAPES.search(ins.line)
                listed = _FLOAT_TYPE.findall(constraints.group(1)) if constraints else []
                operands = tuple(listed[:2]) or ("?",)
                gemm = Gemm(ins.name, "pallas", operands, "grouped GEMM (Pallas)", backward)
                found.append((gemm, ""))
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


# A dot's dimension numbers: (attribute, dimensions).
_DIM_NUMBERS = re.compile(r"\b(\w+_dims)=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_SHAPES = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


def _dims(shape: str) -> list[int] | None:
    """An array shape's dimensions (`bf16[4,8]{1,0}` -> [4, 8]); None for a tuple."""
    m = re.match(r"\s*[a-z]\w*\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else None


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def dot_flops(ins: Instruction, shapes: dict[str, list]) -> int:
    """FLOPs of one execution of a matmul as the math needs them. A `dot`: 2 x its result x
    its contracted extent. A `convolution` (a TPU program's matmul): _convolution_flops. A
    `ragged-dot` (the experts' grouped GEMM: each row meets one group's matrix): 2 x the lhs x
    the rhs's free dimensions, whichever dimension is ragged (a lowering that multiplies every
    row by every group's matrix needs G times it)."""
    line, start = ins.line, ins.operands_at
    names = re.findall(r"%([\w.\-]+)(?:#(\d+))?", line[start : line.find(")", start) + 1])
    operands = []
    for name, index in names[:2]:
        elements = shapes.get(name, [])
        i = int(index or 0)
        operands.append(elements[i] if i < len(elements) else None)
    out = _dims(ins.result)
    if out is None or len(operands) < 2 or None in operands:
        return 0
    lhs, rhs = operands
    attrs = {k: [int(d) for d in v.split(",") if d] for k, v in _DIM_NUMBERS.findall(line)}
    if ins.op == "dot":
        return 2 * _prod(out) * _prod(lhs[d] for d in attrs.get("lhs_contracting_dims", []))
    if ins.op == "convolution":
        return _convolution_flops(line, lhs, rhs, out)
    # ragged-dot
    bound = set(attrs.get("rhs_contracting_dims", []))
    bound |= set(attrs.get("rhs_group_dims", [])) | set(attrs.get("rhs_batch_dims", []))
    return 2 * _prod(lhs) * _prod(n for d, n in enumerate(rhs) if d not in bound)


_COST_FLOPS = re.compile(r'"cost_estimate":\{[^}]*?"flops":"(\d+)"')


def _kernel_flops(ins: Instruction) -> tuple[int, str] | None:
    """(FLOPs, label) of a kernel: a TPU kernel carries its own cost estimate (the TPU compiler
    lowers a ragged dot to one, `ragged-dot-none.N`, a grouped matmul over the rows' groups,
    after a `ragged-dot-metadata` kernel without FLOPs, estimated as the math needs it; a
    Pallas kernel such as splash attention carries the estimate its author wrote); the experts'
    Mosaic GPU grouped GEMMs (_mosaic_grouped_flops) carry none."""
    if ins.op == "custom-call" and ins.target.startswith("mosaic_gpu"):
        return _mosaic_grouped_flops(ins)
    if ins.op != "custom-call" or ins.target != "tpu_custom_call":
        return None
    m = _COST_FLOPS.search(ins.line)
    if not m or not int(m.group(1)):
        return None
    name = (_OP_NAME.search(ins.line) or m).group(0) + ins.name
    label = "ragged_dot" if "ragged-dot" in name or "ragged_dot" in name else ins.name
    return int(m.group(1)), re.sub(r"\.\d+$", "", label)


_OPERAND_SHAPES = re.compile(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}")
_FLOAT_TYPE = re.compile(r"(bf16|f16|f32|f8e4m3fn|f8e5m2)\[")
_FLOAT_SHAPE = re.compile(r"(?:bf16|f16|f32|f8e4m3fn|f8e5m2)\[([\d,]*)\]")


def _mosaic_grouped_flops(ins: Instruction) -> tuple[int, str] | None:
    """The experts' grouped GEMMs on Hopper (jaxdist.kernels.grouped_gemm) as the math needs
    them, read from the kernel's operands (its float operands in order: lhs, rhs) and result:
    in the `grouped_gemm` scope (forward, input gradient) 2 x the result x the lhs's contracted
    width; in `grouped_gemm_wgrad` 2 x the lhs (its rows contracted) x the rhs's width."""
    scope = _op_name(ins.line)
    if "grouped_gemm" not in scope:
        return None
    constraints = _OPERAND_SHAPES.search(ins.line)
    shapes = _FLOAT_SHAPE.findall(constraints.group(1)) if constraints else []
    out = _dims(ins.result)
    if len(shapes) < 2 or out is None:
        return None
    lhs, rhs = ([int(d) for d in s.split(",") if d] for s in shapes[:2])
    if "grouped_gemm_wgrad" in scope:
        return 2 * _prod(lhs) * rhs[-1], "ragged_dot"
    return 2 * _prod(out) * lhs[-1], "ragged_dot"


def _convolution_flops(line: str, lhs: list[int], rhs: list[int], out: list[int]) -> int:
    """2 x the multiply-adds of a convolution that touch the input, not its padding: the TPU
    compiler writes a matmul's batch-like dimensions (an einsum's g and q) as windows over a
    padded input of size 1, of which each output meets one kernel element. Per spatial
    dimension, the (output, kernel) position pairs that land inside the input; times the
    output's batch and features and the kernel's input features."""
    labels = _DIM_LABELS.search(line)
    if not labels:
        return 0
    lhs_l, rhs_l, out_l = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", line)
    fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}
    spatial = sorted(c for c in lhs_l if c.isdigit())

    def per_dim(key: str, default: int) -> list[int]:
        raw = fields.get(key)
        return [int(x) for x in raw.split("x")] if raw else [default] * len(spatial)

    pads = [tuple(int(x) for x in p.split("_")) for p in fields.get("pad", "").split("x") if p]
    strides, dilations = per_dim("stride", 1), per_dim("rhs_dilate", 1)
    pairs = 1
    for k, c in enumerate(spatial):
        n, w, o_n = lhs[lhs_l.index(c)], rhs[rhs_l.index(c)], out[out_l.index(c)]
        lo = pads[k][0] if k < len(pads) else 0
        at = lo - np.arange(w) * dilations[k]  # output p meets kernel k at input p*s - at
        first = np.maximum(0, -(-at // strides[k]))
        last = np.minimum(o_n - 1, (at + n - 1) // strides[k])
        pairs *= int(np.maximum(0, last - first + 1).sum())
    return 2 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * pairs


def _op_name(line: str) -> str:
    m = _OP_NAME.search(line)
    return m.group(1) if m else ""


def matmul_flops(hlo_text: str) -> dict:
    """The matmul FLOPs of one execution of a compiled program, each dot, convolution, ragged
    dot and TPU kernel with a cost estimate (_kernel_flops) times the executions of its
    computation (loop trip counts multiplied in, as jaxdist.compiled.hlo counts collectives).
    `total`; `by_op` (dot, convolution, ragged-dot, custom-call); `by_label` (what made each:
    an einsum, a named scope, `ragged_dot`, a kernel's name); `ragged_dots`: the grouped
    GEMMs' FLOPs as the compiled program runs them: as the math needs them (each row times its
    own group's matrix) where a ragged dot stays one (TPU: a grouped-matmul kernel); G times
    that where it became dense dots over every group, each row times every group's matrix
    (JAX on XLA:CPU; XLA's GPU compiler, jax 0.11.2: dots whose op_name says ragged_dot)."""
    from jaxdist.compiled.hlo import _computations, _multiplicities

    comps, entry = _computations(hlo_text)
    runs = _multiplicities(comps, entry, None)
    out = {"total": 0, "by_op": {}, "by_label": {}, "ragged_dots": 0}
    for ins, flops, label in each_matmul(hlo_text):
        if not runs.get(ins.computation):
            continue
        flops *= runs[ins.computation]
        out["total"] += flops
        out["by_op"][ins.op] = out["by_op"].get(ins.op, 0) + flops
        out["by_label"][label] = out["by_label"].get(label, 0) + flops
        if label == "ragged_dot":
            out["ragged_dots"] += flops
    return out


def each_matmul(hlo_text: str):
    """Each matmul instruction of the program (a dot, convolution, ragged dot, or a kernel whose
    FLOPs are known: _kernel_flops) with its FLOPs for one execution and its label."""
    shapes: dict[str, list] = {}
    computation = None
    for ins in instructions(hlo_text):
        if ins.computation != computation:
            computation, shapes = ins.computation, {}
        shapes[ins.name] = [
            [int(d) for d in dims.split(",") if d] for _, dims in _SHAPES.findall(ins.result)
        ]
        kernel = _kernel_flops(ins)
        if kernel:
            yield ins, *kernel
        elif ins.op in _DOT_OPS:
            ragged = ins.op == "ragged-dot" or "ragged_dot" in _op_name(ins.line)
            yield ins, dot_flops(ins, shapes), "ragged_dot" if ragged else _label(ins.line)[0]
