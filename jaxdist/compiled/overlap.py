"""What a compiled program's schedule runs under each asynchronous collective.

An optimized HLO module is scheduled: each computation's instructions are printed in the order
they run. An asynchronous collective is a start and a done (`all-gather-start` ...
`all-gather-done`, or `async-start(..., calls=%c)` ... `async-done` around a collective, as
libtpu writes its asynchronous ragged all-to-all); whatever the schedule places between the two
runs while the collective moves its bytes. Here that is counted as matmul FLOPs (each dot,
convolution or kernel with known FLOPs, inside fusions and calls too: jaxdist.compiled.gemms),
per collective, loop trips multiplied in as jaxdist.compiled.hlo counts collectives.

This is the compiled program's promise, not a measurement: the time the collective takes
against the time of the compute under it is what a profile shows (jaxdist.profiling splits a
step's collectives into exposed and hidden). A synchronous collective has nothing under it.
"""

import dataclasses
import re

from jaxdist.compiled import gemms, hlo

_CALLS = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One asynchronous collective: its kind, mesh axes, the bytes of its result, how often it
    runs per step, and the matmul FLOPs the schedule places between its start and done."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    executions: float
    flops_under: int


def _called(line: str) -> list[str]:
    names = _CALLS.findall(line)
    branches = _BRANCHES.search(line)
    if branches:
        names += re.findall(r"%([\w.\-]+)", branches.group(1))
    return names


def _computation_flops(
    hlo_text: str, comps: dict[str, list[str]]
) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """Matmul FLOPs of one run of each computation, what it calls included, and of each matmul
    instruction by (computation, name)."""
    each: dict[tuple[str, str], int] = {}
    direct: dict[str, int] = {}
    for ins, flops, _ in gemms.each_matmul(hlo_text):
        each[ins.computation, ins.name] = flops
        direct[ins.computation] = direct.get(ins.computation, 0) + flops
    total: dict[str, int] = {}

    def of(comp: str, seen: frozenset = frozenset()) -> int:
        if comp in total:
            return total[comp]
        if comp in seen:
            return 0
        inner = sum(of(c, seen | {comp}) for line in comps.get(comp, []) for c in _called(line))
        total[comp] = direct.get(comp, 0) + inner
        return total[comp]

    for comp in comps:
        of(comp)
    return total, each


def scheduled(hlo_text: str, mesh_shape: dict[str, int]) -> list[Scheduled]:
    """Every asynchronous collective of an optimized module with the matmul FLOPs scheduled
    under it (module docstring); collectives over size-1 groups are left out."""
    comps, entry = hlo._computations(hlo_text)
    runs = hlo._multiplicities(comps, entry, None)
    flops, each = _computation_flops(hlo_text, comps)
    # The collective each start stands for: its own op, or the one in its async computation.
    inside = {
        c: next(hlo.INSTRUCTION.match(x) for x in lines if _collective_line(x))
        for c, lines in comps.items()
        if any(_collective_line(x) for x in lines)
    }
    found: list[Scheduled] = []
    for comp, lines in comps.items():
        if not runs.get(comp):
            continue
        open_: dict[str, list] = {}  # start name -> [kind, rest, result, flops under]
        for line in lines:
            m = hlo.INSTRUCTION.match(line)
            if not m:
                continue
            name, result, op, rest = m.group(2), m.group(3), m.group(4), m.group(5)
            if op.endswith("-start") or op == "async-start":
                collective = _start_of(op, rest, line, inside)
                if collective:
                    open_[name] = [*collective, 0]
                continue
            if op.endswith("-done") or op == "async-done":
                operand = re.match(r"\s*%([\w.\-]+)", rest)
                started = open_.pop(operand.group(1), None) if operand else None
                if started:
                    kind, where, under = started[0], started[1], started[2]
                    axes = hlo._axes_of(hlo._groups(where, mesh_shape), mesh_shape)
                    if axes:
                        size = hlo._moved_bytes(kind, result, where, mesh_shape)
                        found.append(Scheduled(kind, axes, size, runs[comp], under))
                continue
            work = sum(flops.get(c, 0) for c in _called(line)) + each.get((comp, name), 0)
            for started in open_.values():
                started[2] += work
    return found


def _collective_line(line: str) -> bool:
    m = hlo.INSTRUCTION.match(line)
    return bool(m) and hlo.opcode(m.group(4)) in hlo.COLLECTIVES


def _start_of(op: str, rest: str, line: str, inside: dict) -> tuple[str, str] | None:
    """(kind, the text its replica groups are read from) of an async start, or None where it
    starts something else (a copy, a slice, a host offload)."""
    if op != "async-start":
        kind = hlo.opcode(op)
        return (kind, rest) if kind in hlo.COLLECTIVES else None
    called = _CALLS.search(line)
    m = inside.get(called.group(1)) if called else None
    return (hlo.opcode(m.group(4)), m.group(5)) if m else None


def summary(found: list[Scheduled]) -> dict[str, dict]:
    """By `axes kind`: count per step, how many have matmuls under them, the FLOPs under them
    per step, and bytes per step."""
    rows: dict[str, dict] = {}
    for s in found:
        row = rows.setdefault(
            f"{'+'.join(s.axes)} {s.kind}",
            {"count": 0, "with_compute": 0, "flops_under": 0, "bytes": 0},
        )
        row["count"] += round(s.executions)
        row["with_compute"] += round(s.executions) if s.flops_under else 0
        row["flops_under"] += s.executions * s.flops_under
        row["bytes"] += s.executions * s.bytes
    return rows
