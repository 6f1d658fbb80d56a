"""Reads compiled HLO text: its computations and instructions (`instructions`, which
jaxdist.compiled.gemms reads too), and its collectives: kind, bytes, mesh axes, times executed.

XLA prints replica groups three ways (explicit `{{0,1},{2,3}}`, iota `[4,2]<=[2,4]T(1,0)`, and
`mesh[...] {'fsdp'}`); all three are mapped back to the mesh axes the group spans. Ops inside
while loops (the layer scan) count once per iteration, from XLA's known_trip_count.
"""

import dataclasses
import re
from collections.abc import Iterator

import numpy as np

# Every collective op XLA emits; async ones come as `<kind>-start` / `<kind>-done` pairs.
COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
    "send",
    "recv",
)
# Bytes per element of each HLO element type; the GEMM census derives bits from it.
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e4m3fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "f8e5m2": 1,
    "f8e5m2fnuz": 1,
}
# A computation's first line (`ENTRY %main (...) -> ... {`): (ENTRY or not, its name).
COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
# An instruction: (ROOT or not, name, result shape, op, the rest from its operands on).
INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
# The library call of a custom-call (cuBLAS, cuDNN, a Pallas kernel, a host transfer).
TARGET = re.compile(r'custom_call_target="([^"]+)"')
# An array shape: (element type, dimensions).
_SHAPE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


def base_name(name: str) -> str:
    """`all-reduce-start.3` -> `all-reduce.3`: an async pair's two halves under one name."""
    return name.replace("-start", "").replace("-done", "")


def opcode(name: str) -> str:
    """`all-reduce-start.3` -> `all-reduce`."""
    return re.sub(r"-(start|done)$", "", re.sub(r"\.\d+$", "", name))


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # per device, per execution: the full buffer the group reduces or gathers
    axes: tuple[str, ...]  # mesh axes whose devices exchange data in this op
    executions: float  # times it runs per step (loop trip counts and branch shares multiplied in)
    name: str


def shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in DTYPE_BYTES:
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            total += n * DTYPE_BYTES[dtype]
    return total


@dataclasses.dataclass(frozen=True)
class Instruction:
    computation: str  # the computation it is in
    name: str
    result: str  # its shape: `bf16[4,8]{1,0}`, or a tuple's `(f32[2], s8[16])`
    op: str
    line: str
    operands_at: int  # where in `line` its operand list opens

    @property
    def types(self) -> tuple[str, ...]:
        """Its result's element types, one per tuple element (nested tuples flattened)."""
        return tuple(dtype for dtype, _ in _SHAPE.findall(self.result))

    @property
    def target(self) -> str:
        """A custom-call's library call; "" for other ops."""
        m = TARGET.search(self.line)
        return m.group(1) if m else ""


def instructions(hlo_text: str) -> Iterator[Instruction]:
    """Every instruction of the program in the order printed, each with its computation."""
    computation = ""
    for line in hlo_text.splitlines():
        header = COMPUTATION.match(line)
        if header:
            computation = header.group(2)
            continue
        m = INSTRUCTION.match(line)
        if m:
            name, result, op = m.group(2, 3, 4)
            yield Instruction(computation, name, result, op, line, m.start(5) - 1)


def _groups(attrs: str, mesh_shape: dict[str, int]) -> list[list[int]] | tuple[str, ...]:
    """Device-id groups, or directly the axis names when XLA printed them."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        printed = [
            (n.strip(" '"), int(v))
            for n, v in (kv.split("=") for kv in m.group(1).split(",") if kv.strip())
        ]
        spanned = [a.strip(" '") for a in m.group(2).split(",") if a.strip(" '")]
        if all(n in mesh_shape for n, _ in printed):
            # A group along size-1 axes exchanges nothing (XLA keeps such no-ops on CPU).
            # In mesh order, as the other two forms give them.
            return tuple(a for a in mesh_shape if a in spanned and mesh_shape[a] > 1)
        # XLA named the axes itself (axis_0, ...): rebuild the device groups from its mesh.
        names, sizes = [n for n, _ in printed], [v for _, v in printed]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        keep = [i for i, n in enumerate(names) if n not in spanned]
        moved = np.moveaxis(ids, keep, list(range(len(keep))))
        return moved.reshape(int(np.prod([sizes[i] for i in keep])), -1).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        out_shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(int(np.prod([int(x) for x in m.group(2).split(",")])))
        ids = ids.reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(out_shape[0], -1).tolist()
    m = re.search(r"(replica_groups|source_target_pairs)=\{(\{[\d,{}\s]*\})\}", attrs)
    if m:
        return [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(2))
        ]
    n = int(np.prod(list(mesh_shape.values())))
    return [list(range(n))]  # empty replica_groups: all devices


def _axes_of(groups, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    if isinstance(groups, tuple):
        return groups
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying: set[int] = set()
    for group in groups:
        coords = np.array([np.unravel_index(i, sizes) for i in group])
        if len(coords):
            varying |= {k for k in range(len(names)) if len(set(coords[:, k])) > 1}
    return tuple(names[k] for k in sorted(varying))


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines by name, and the ENTRY computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = COMPUTATION.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif current is not None and line.strip() != "}":
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _multiplicities(
    comps: dict[str, list[str]], entry: str, branch_share: dict[int, tuple[float, ...]] | None
) -> dict[str, float]:
    """Times each computation runs per execution of ENTRY: the calls walked from ENTRY, loop
    trip counts and branch shares multiplied in."""
    mult: dict[str, float] = {entry: 1}
    trips: dict[str, int] = {}  # a loop body's trip count, for the conditionals inside it
    order = [entry]
    while order:
        comp = order.pop()
        for line in comps.get(comp, []):
            trip = 1
            if " while(" in line:
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                trip = int(m.group(1)) if m else _trip_from_condition(line, comps)
            calls = re.findall(r"\b(body|calls)=%([\w.\-]+)", line)
            calls += _branch_calls(line, comps[comp], trips.get(comp), branch_share)
            for key, callee in calls:
                times = mult[comp] * (
                    trip if key == "body" else key if isinstance(key, float) else 1
                )
                if key == "body":  # a body reached by loops of other trips: share unknown
                    trips[callee] = trip if trips.get(callee, trip) == trip else 0
                mult[callee] = mult.get(callee, 0) + times
                order.append(callee)
    return mult


def _branch_calls(line: str, lines: list[str], trip: int | None, branch_share) -> list:
    """A conditional's branches, (share of the executions it takes, name). Each counted as if
    taken every time (an upper bound, since which branch runs is only known at run time) unless
    its share is known: from the caller (`branch_share`, for n-way conditionals), or from a
    predicated conditional's predicate (true_/false_computation: the TPU compiler's one-way
    windowed einsum skips its ring's last send so, `counter + 1 < n` in an n-trip loop)."""
    calls = []
    for branches in re.findall(r"\bbranch_computations=\{([^}]*)\}", line):
        names = [b.strip().lstrip("%") for b in branches.split(",")]
        share = (branch_share or {}).get(len(names), (1.0,) * len(names))
        calls += [(share[i], b) for i, b in enumerate(names)]
    pair = re.search(r"true_computation=%([\w.\-]+), false_computation=%([\w.\-]+)", line)
    if pair:
        taken = _true_share(line, lines, trip)
        shares = (1.0, 1.0) if taken is None else (taken, 1.0 - taken)
        calls += list(zip(shares, pair.groups(), strict=True))
    return calls


def _true_share(line: str, lines: list[str], trip: int | None) -> float | None:
    """The share of a loop's `trip` iterations in which a conditional's predicate holds, where
    it is `compare(add(counter, a), b), direction=LT` with constants a and b and the counter an
    element of the loop's state (taken to run from 0 by 1, as a scan's does): (b - a) / trip,
    clipped to [0, 1]. None for any other form, or a trip count not known (0, or 1: the
    fallback of _trip_from_condition)."""
    pred = re.search(r" conditional\(%([\w.\-]+)", line)
    if not trip or trip < 2 or not pred:
        return None
    defs = {m.group(2): m for m in map(INSTRUCTION.match, lines) if m}
    cmp = defs.get(pred.group(1))
    if not cmp or cmp.group(4) != "compare" or "direction=LT" not in cmp.group(5):
        return None
    operands = re.findall(r"%([\w.\-]+)", cmp.group(5).split(")")[0])
    if len(operands) != 2:
        return None
    lhs, rhs = operands
    add = defs.get(lhs)
    const = _counter_constants(lines)
    if not add or add.group(4) != "add" or rhs not in const:
        return None
    # The counter: an element of the loop state, by get-tuple-element or, as the TPU compiler
    # prints a loop it widened, `%param#k`.
    terms = re.findall(r"%([\w.\-]+)(#\d+)?", add.group(5).split(")")[0])
    step = [const[x] for x, _ in terms if x in const]
    counter = [(defs.get(x), element) for x, element in terms if x not in const]
    if len(step) != 1 or len(counter) != 1 or not counter[0][0]:
        return None
    op = counter[0][0].group(4)
    if not (op == "get-tuple-element" or (op == "parameter" and counter[0][1])):
        return None
    return min(max((const[rhs] - step[0]) / trip, 0.0), 1.0)


def _moved_bytes(kind: str, result: str, rest: str, mesh_shape: dict[str, int]) -> int:
    """Bytes per device of one execution: the result's, or for a reduce-scatter the full
    buffer it reduces (the result times the group size)."""
    size = shape_bytes(result)
    if kind == "reduce-scatter":
        groups = _groups(rest, mesh_shape)
        group_size = (
            int(np.prod([mesh_shape[a] for a in groups]))
            if isinstance(groups, tuple)
            else len(groups[0])
        )
        size *= group_size
    return size


def collectives(
    hlo_text: str,
    mesh_shape: dict[str, int],
    branch_share: dict[int, tuple[float, ...]] | None = None,
) -> list[Collective]:
    """Every collective in the module with how often it runs in one execution of ENTRY.

    `branch_share`: for conditionals of n branches, the share of executions each branch takes,
    where the caller knows it (the pipeline's tick switch: idle, forward, backward, from its
    schedule). A predicated conditional (true_/false_computation) takes its share from its
    predicate where that is a loop counter's (_true_share); other conditionals count every
    branch as taken every time, an upper bound. All-reduces in XLA:TPU's reduce-scatter fusion
    count as reduce-scatters (_scatters)."""
    comps, entry = _computations(hlo_text)
    mult = _multiplicities(comps, entry, branch_share)
    starts: dict[str, tuple[str, str]] = {}
    found: list[Collective] = []
    for comp, lines in comps.items():
        if comp not in mult:
            continue
        for line in lines:
            m = INSTRUCTION.match(line)
            if not m:
                continue
            name, result, op, rest = m.group(2), m.group(3), m.group(4), m.group(5)
            kind = opcode(op)
            if kind not in COLLECTIVES:
                continue
            if op.endswith("-start"):
                starts[name] = (kind, rest)
                continue
            if op.endswith("-done"):
                operand = re.match(r"\s*%([\w.\-]+)", rest)
                kind, rest = starts.get(operand.group(1) if operand else "", (kind, rest))
            size = _moved_bytes(kind, result, rest, mesh_shape)
            if kind == "all-reduce" and _scatters(comp, lines, name):
                kind = "reduce-scatter"  # the full buffer it reduces: the all-reduce's
            axes = _axes_of(_groups(rest, mesh_shape), mesh_shape)
            if not axes:
                continue  # every group is one device: nothing moves
            found.append(Collective(kind, size, axes, mult[comp], name))
    return found


def _scatters(comp: str, lines: list[str], name: str) -> bool:
    """Whether all-reduce `name` is the TPU's reduce-scatter: XLA:TPU rewrites an all-reduce
    whose result each device slices to its own part into a fusion (`all-reduce-scatter.N`, its
    ROOT that dynamic-slice) that runs as a reduce-scatter, half an all-reduce's bytes on the
    wire (a public profile of MaxText on TPU, and the fusion's off switch,
    `xla_tpu_enable_all_reduce_scatter_fusion=false`, turning it back into an all-reduce)."""
    if not comp.startswith("all-reduce-scatter"):
        return False
    root = _root(lines)
    return " dynamic-slice(" in root and f"%{name}," in root


def _trip_from_condition(line: str, comps: dict[str, list[str]]) -> int:
    """A loop's trip count where XLA printed none (the TPU compiler does not): a counter from
    0 compared `LT` against a constant in its condition, as every `lax.scan` compiles to
    (an s32 counter, or u32 where XLA proved it never negative); 1 when the condition has
    another form."""
    cond = re.search(r"\bcondition=%([\w.\-]+)", line)
    body = comps.get(cond.group(1), []) if cond else []
    root = _root(body)
    if " compare(" not in root or "direction=LT" not in root:
        return 1
    return next((n for name, n in _counter_constants(body).items() if name in root), 1)


_COUNTER_CONSTANT = re.compile(r"^\s*%([\w.\-]+) = [su]32\[\][^ ]* constant\((\d+)\)")


def _counter_constants(lines: list[str]) -> dict[str, int]:
    """A computation's scalar s32 and u32 constants by name: a loop's bounds and steps."""
    return {m.group(1): int(m.group(2)) for m in map(_COUNTER_CONSTANT.match, lines) if m}


def _root(lines: list[str]) -> str:
    return next((x for x in lines if x.lstrip().startswith("ROOT ")), "")


def summarize(found: list[Collective]) -> dict[tuple[str, str], dict[str, int]]:
    """(axis label, kind) -> count and bytes per step; `a+b` labels ops spanning two axes."""
    rows: dict[tuple[str, str], dict[str, int]] = {}
    for c in found:
        key = ("+".join(c.axes) or "none", c.kind)
        row = rows.setdefault(key, {"count": 0, "bytes": 0})
        row["count"] += round(c.executions)
        row["bytes"] += c.executions * c.bytes
    return rows
