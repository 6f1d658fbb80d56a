"""Pipeline schedules: which microbatch each stage runs forward or backward, tick by tick.

Every schedule is a fixed order of ops per stage; the simulation runs each stage's next op as
soon as its input is there (a forward needs the previous chunk's forward of that microbatch one
tick earlier or before, a backward the next chunk's backward), idling otherwise:

  gpipe        all forwards, then all backwards: m inputs per stage; bubble (p-1)/(m+p-1)
  1f1b         p-s-1 warm-up forwards, then one forward and one backward in turn: at most p
               inputs per stage, the same bubble
  interleaved  Megatron's interleaved 1F1B: v chunks per stage (stage s holds chunks s, s+p,
               ...); forwards in groups of p microbatches, chunk by chunk, backwards the same
               with the chunks reversed; (v-1)p + p-s-1 warm-up forwards, then 1F1B. Bubble
               (p-1)/(vm+p-1) of the ticks, i.e. (p-1)/(vm) of the busy time, with at most
               (v-1)p + p-s inputs in flight on stage s; m must be a multiple of p.

Why interleaved 1F1B and not an interleaved GPipe: it keeps the v-fold smaller bubble while the
inputs held stay bounded by the warm-up, not by m. Megatron warms up with 2(p-s-1) + (v-1)p
forwards, the extra p-s-1 giving slack for backwards slower than forwards; here every tick is
one op on every stage in lock step (permutes end each tick), so the shorter warm-up gives the
same 2(vm+p-1) ticks with p-s-1 fewer inputs held.
"""

import dataclasses
import functools
from typing import get_args

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.layout import Layout, PipelineSchedule

SCHEDULES = get_args(PipelineSchedule)


@dataclasses.dataclass(frozen=True)
class Schedule:
    ops: np.ndarray  # [ticks, stages]: 0 idle, 1 forward, 2 backward
    mbs: np.ndarray  # [ticks, stages]: the microbatch of that op
    chunks: np.ndarray  # [ticks, stages]: which of the stage's virtual stages runs it
    capacity: int  # inputs a stage holds at most, per virtual stage
    virtual: int = 1  # layer chunks per stage

    @property
    def ticks(self) -> int:
        return self.ops.shape[0]

    @property
    def stages(self) -> int:
        return self.ops.shape[1]

    def bubble(self) -> float:
        """Share of stage-ticks idle."""
        return float(np.mean(self.ops == 0))

    def slots(self) -> np.ndarray:
        """[ticks, stages]: the buffer slot of each op's microbatch (chunk-major)."""
        return self.chunks * self.capacity + self.mbs % self.capacity


def _check(kind: str, p: int, m: int, v: int) -> None:
    if kind not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {kind!r}: use one of {', '.join(SCHEDULES)}")
    if kind != "interleaved" and v != 1:
        raise ConfigError(
            f"--virtual-stages {v} needs --pipeline-schedule interleaved (with {kind}: 1)"
        )
    if kind == "interleaved" and v < 2:
        raise ConfigError(
            f"interleaved needs --virtual-stages 2 or more (got {v}; with 1 it is 1f1b)"
        )
    if kind == "1f1b" and m < p:
        raise ConfigError(
            f"1f1b needs at least as many microbatches as stages ({m} < {p}); "
            f"use --microbatches {p} or more"
        )
    if kind == "interleaved" and m % p:
        fix = f"{m - m % p} or {m - m % p + p}" if m > p else str(p)
        raise ConfigError(
            f"interleaved needs the microbatches to be a multiple of the {p} pipeline stages "
            f"(got {m}); use --microbatches {fix}"
        )


def _orders(kind: str, p: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    """Per stage, its ops in order as (op, chunk, microbatch)."""
    if kind == "interleaved":
        groups = [range(g, g + p) for g in range(0, m, p)]
        fwd = [(1, k, i) for g in groups for k in range(v) for i in g]
        bwd = [(2, k, i) for g in groups for k in reversed(range(v)) for i in g]
    else:
        fwd = [(1, 0, i) for i in range(m)]
        bwd = [(2, 0, i) for i in range(m)]
    orders = []
    for s in range(p):
        if kind == "gpipe":
            orders.append(fwd + bwd)
            continue
        warm = min(len(fwd), (v - 1) * p + p - s - 1)
        steady = [op for pair in zip(fwd[warm:], bwd, strict=False) for op in pair]
        orders.append(fwd[:warm] + steady + bwd[len(fwd) - warm :])
    return orders


# A schedule is a pure function of its four numbers, simulated tick by tick (milliseconds): the
# planner asks for the same one for each term of each layout, so it is simulated once. Its
# arrays are read-only.
@functools.lru_cache(maxsize=512)
def make_schedule(kind: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Simulates the schedule tick by tick; with v virtual stages a microbatch runs through
    chunks 0..pv-1, chunk c on stage c % p (as its virtual stage c // p)."""
    p, m, v = stages, microbatches, virtual_stages
    _check(kind, p, m, v)
    C = p * v
    f_done = np.full((C, m), -1)
    b_done = np.full((C, m), -1)
    orders = _orders(kind, p, m, v)
    pos = [0] * p
    ops, mbs, chunks = [], [], []
    t = 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row_op, row_mb, row_k = [0] * p, [0] * p, [0] * p
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            op, k, i = orders[s][pos[s]]
            c = k * p + s
            if op == 1:
                ready = c == 0 or 0 <= f_done[c - 1, i] < t
            else:
                ready = 0 <= f_done[c, i] < t and (c == C - 1 or 0 <= b_done[c + 1, i] < t)
            if ready:
                (f_done if op == 1 else b_done)[c, i] = t
                row_op[s], row_mb[s], row_k[s] = op, i, k
                pos[s] += 1
        ops.append(row_op)
        mbs.append(row_mb)
        chunks.append(row_k)
        t += 1
        if t > 4 * (m * v + p) + 8:
            raise RuntimeError(f"schedule {kind} did not finish for p={p}, m={m}, v={v}")
    ops_a, mbs_a, chunks_a = np.array(ops), np.array(mbs), np.array(chunks)
    if kind == "interleaved":
        capacity = _live_max(ops_a, mbs_a, chunks_a, v)
    else:
        capacity = p if kind == "1f1b" else m
    for a in (ops_a, mbs_a, chunks_a):
        a.setflags(write=False)
    return Schedule(ops_a, mbs_a, chunks_a, capacity, v)


def _live_max(ops: np.ndarray, mbs: np.ndarray, chunks: np.ndarray, v: int) -> int:
    """The most microbatches any one chunk keeps at once in a buffer (forward inbox, stash,
    backward inbox), counting an entry live from the tick it lands to the tick it is used;
    entries come and go in microbatch order, so slots mb % capacity never collide."""
    ticks, p = ops.shape
    C = p * v
    f_at, b_at = np.full((C, mbs.max() + 1), -1), np.full((C, mbs.max() + 1), -1)
    for t, s in zip(*np.nonzero(ops), strict=True):
        at = f_at if ops[t, s] == 1 else b_at
        at[chunks[t, s] * p + s, mbs[t, s]] = t
    spans = [(f_at[c - 1] + 1, f_at[c]) for c in range(1, C)]  # forward inbox
    spans += [(f_at[c], b_at[c]) for c in range(C)]  # stash
    spans += [(b_at[c + 1] + 1, b_at[c]) for c in range(C - 1)]  # backward inbox
    spans += [(f_at[C - 1], b_at[C - 1])]  # the last chunk's own loss gradient
    live = 0
    for start, end in spans:
        for t in range(ticks):
            live = max(live, int(np.sum((start <= t) & (t <= end))))
    return live


def permute_bytes(
    schedule: Schedule,
    activation_bytes: float,
    layer_bytes: float = 0.0,
    grad_bytes: float | None = None,
) -> float:
    """Bytes each device sends per step: both permutes run every tick (idle stages send
    zeros), each carrying one microbatch's activation (forward) or its gradient (backward).
    They must: a permute is a collective every device of the pipeline axis joins, and inside
    the tick's branch it would need sender and receiver in the same branch, which the schedule
    does not give; so idle ticks pay 2 x activation bytes, priced here. Interleaved also
    moves its stored layer shard (`layer_bytes` per device) into chunk placement and the
    gradients (`grad_bytes`, default the same) back, see `shuffle_plan`."""
    moved = 0.0
    if schedule.virtual > 1:
        plan = shuffle_plan(schedule.stages, schedule.virtual)
        grad_bytes = layer_bytes if grad_bytes is None else grad_bytes
        moved = (
            sum(len(j[0]) for d, j, _ in plan if d) * (layer_bytes + grad_bytes) / schedule.virtual
        )
    return 2 * schedule.ticks * activation_bytes + moved


def recv_table(schedule: Schedule, op: int) -> np.ndarray:
    """[ticks, stages]: the slot where the activation (op 1, from the previous chunk) or the
    gradient (op 2, from the next chunk) sent on the previous tick lands, or -1."""
    t, p = schedule.ops.shape
    C, step = p * schedule.virtual, 1 if op == 1 else -1
    out = np.full((t, p), -1)
    for tick in range(1, t):
        for src in range(p):
            if schedule.ops[tick - 1, src] != op:
                continue
            c = schedule.chunks[tick - 1, src] * p + src + step
            if 0 <= c < C:
                i = schedule.mbs[tick - 1, src]
                out[tick, c % p] = (c // p) * schedule.capacity + i % schedule.capacity
    return out


def shuffle_plan(p: int, v: int, back: bool = False) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """How chunks move between the stored layout (stage d holds chunks dv..dv+v-1: the
    `layers` dim split in p contiguous blocks) and the interleaved one (stage d holds chunks
    d, d+p, ...): per ring shift, [stage, n] the local slots each stage sends and [stage, n]
    the slots the receiving stage writes them to (padded with v, a scratch slot)."""
    stored = [(c // v, c % v) for c in range(p * v)]
    placed = [(c % p, c // p) for c in range(p * v)]
    src, dst = (placed, stored) if back else (stored, placed)
    sends: dict[int, list[list[tuple[int, int]]]] = {}
    for (sd, sj), (dd, dk) in zip(src, dst, strict=True):
        sends.setdefault((dd - sd) % p, [[] for _ in range(p)])[sd].append((sj, dk))
    plan = []
    for shift, rows in sorted(sends.items()):
        n = max(len(row) for row in rows)
        send_j = np.zeros((p, n), np.int32)
        recv_k = np.full((p, n), v, np.int32)
        for d, row in enumerate(rows):
            for a, (j, k) in enumerate(row):
                send_j[d, a] = j
                recv_k[(d + shift) % p, a] = k
        plan.append((shift, send_j, recv_k))
    return plan


def for_layout(layout: Layout) -> Schedule | None:
    """The layout's schedule over its `pipeline` axis (None without one): the one the step
    runs and the planner prices."""
    if layout.stages <= 1:
        return None
    step = layout.step
    return make_schedule(
        step.pipeline_schedule, layout.stages, step.microbatches, layout.virtual_stages
    )
