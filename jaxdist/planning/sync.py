"""The price of replica groups (DiLoCo: jaxdist.parallel.replica) before the fleet is rented.

A layout with a `replica` axis of M groups and a SyncConfig runs, per step, one group's inner
step (the planner prices it as any layout: the group's block of the batch, B/M rows, over the
other axes) and, every H/F steps, one fragment's outer exchange over the slow link between the
groups (hardware `outer`: InfiniBand, DCN). Per device:

- memory: the outer state beside the inner one (12 bytes a parameter with AdamW): 8/M bytes a
  parameter for float32 and bfloat16 sync (outer weights and momentum split over `replica`),
  4 + 4/M for the 8-bit types (every group keeps the outer weights); `outer_state_bytes`, read
  by planning.memory.device_peak, the one price of memory;
- time: the exchange is an all-to-all of the device's share of its group's weights in the
  sync type onto their owners, then an all-gather back (8-bit: plus a float32 scale per row),
  in the collectives parallel.exchange sends (one per bucket of each kind of buffer: the 8-bit
  scales apart from the weights, a leaf over its BUCKET_BYTES alone), each priced by
  planning.costmodel on the link the groups span, each paying its latency. Amortized over the
  H/F steps of a fragment's turn; with `--sync-delay T` it runs beside the next T inner
  steps, so up to T steps' compute hides it; with T = 0 it is exposed.

`bandwidth_for` solves for the slow link's bandwidth at which a layout reaches a compute
utilization (compute / (compute + exposed communication)); experiments/diloco_bandwidth.py
does the same for Charles et al.'s idealized setting (arXiv:2503.09799, Table 6).
"""

import dataclasses
import math
from collections.abc import Callable

from jaxdist.hardware import Hardware, with_slow_link
from jaxdist.layout import Layout, SyncConfig
from jaxdist.parallel import exchange, replica
from jaxdist.planning import costmodel
from jaxdist.rules import logical_axes, variables

# planning.layouts reads it here until its why_not is rewritten: the constant is mesh.REPLICA.
# The compute utilization `plan` quotes each layout's slow-link bandwidth for: compute /
# (compute + exposed communication), as Charles et al. (arXiv:2503.09799, Table 6) quote it.
TARGET_UTILIZATION = 0.8


def outer_state_bytes(params_bytes: float, layout: Layout) -> float:
    """One device's outer state, from its fp32 weights' bytes (4 a parameter): 8/M bytes a
    parameter (float32, bfloat16 sync), 4 + 4/M (8-bit sync); 0 without replica groups."""
    if not layout.grouped:
        return 0.0
    M = layout.replicas
    per_param = 4 + 4 / M if replica.keeps_outer_copy(layout.sync) else 8 / M
    return params_bytes / 4 * per_param


def _fragments(abstract_params, layout: Layout) -> list[tuple[list, list, list]]:
    """Per fragment, the (shapes, specs, owners) of the leaves it sends, as
    parallel.replica lays them out: layer l in fragment l % F (its layers dim cut F ways, the
    owners not split on it), the weights outside the layers in fragment 0."""
    F, mesh_shape = layout.sync.sync_fragments, layout.mesh_shape
    out: list[tuple[list, list, list]] = [([], [], []) for _ in range(F)]
    for var in variables(abstract_params):
        logical = logical_axes(var)
        where = replica.leaf(var.shape, logical, layout.rules.spec(logical, "param"), mesh_shape, F)
        shape = list(var.shape)
        if where.dim is not None:
            shape[where.dim] //= F
        for f in range(F) if where.dim is not None else (0,):
            for part, x in zip(out[f], (tuple(shape), where.spec, where.owner), strict=True):
                part.append(x)
    return out


def exchange_messages(abstract_params, layout: Layout) -> list[dict[str, list[float]]]:
    """Per fragment, one device's collectives over `replica` by kind, each its bytes in
    planning.traffic's convention (the full buffer): the all-to-all up and the all-gather
    down of the group's weights in the sync type, one per bucket (parallel.exchange's
    BUCKET_BYTES, a larger leaf alone), and for the 8-bit types their float32 scales (one per
    row of each device's block) in collectives of their own, as parallel.exchange sends them."""
    dtype = layout.sync.sync_dtype
    return [
        exchange.messages(*leaves, dtype, layout.mesh_shape)
        for leaves in _fragments(abstract_params, layout)
    ]


def exchange_bytes(abstract_params, layout: Layout) -> dict[str, float]:
    """One device's bytes of a whole outer exchange (every fragment), by collective."""
    return totals(exchange_messages(abstract_params, layout))


def totals(messages: list[dict[str, list[float]]]) -> dict[str, float]:
    return {k: sum(sum(f[k]) for f in messages) for k in ("all-to-all", "all-gather")}


def exchange_seconds(messages: list[dict[str, list[float]]], layout: Layout, hw: Hardware) -> float:
    """Seconds of one fragment's exchange between the M groups (the mean over fragments:
    fragment 0 also sends the weights outside the layers), on the link they span: devices of
    a group sit between a group's members. Each message pays the link's latency."""
    M = layout.replicas
    stride = layout.devices // M
    return sum(
        costmodel.spanning_time(kind, nbytes, M, stride, hw)
        for fragment in messages
        for kind, sizes in fragment.items()
        for nbytes in sizes
    ) / len(messages)


def outer_terms(sync: SyncConfig, exchange_s: float, compute_s: float) -> dict[str, float]:
    """Per inner step: the outer exchanges amortized over H (F of them, each of
    `exchange_s`), the part the next T steps' compute hides (`--sync-delay T`), and the rest,
    exposed."""
    H, F, T = sync.sync_every, sync.sync_fragments, sync.sync_delay
    hidden = min(exchange_s, T * compute_s)
    return {
        "outer_exchange_s": exchange_s,
        "outer_s": F * exchange_s / H,
        "outer_hidden_s": F * hidden / H,
        "outer_exposed_s": F * (exchange_s - hidden) / H,
    }


def with_outer(row: dict, abstract_params, layout: Layout, hw: Hardware) -> dict:
    """The plan's row of a grouped layout, from its group's inner-step row: the outer step's
    amortized exposed time joins the step; the layout, mesh and throughput are the whole
    fleet's (every group steps at once on its own block of the batch)."""
    messages = exchange_messages(abstract_params, layout)
    terms = outer_terms(layout.sync, exchange_seconds(messages, layout, hw), row["compute_s"])
    step = row["step_s"] + terms["outer_exposed_s"]
    tokens = layout.batch_size * layout.seq_len
    return {
        **row,
        **terms,
        "layout": layout.describe(),
        "mesh": layout.mesh_shape,
        "replicas": layout.replicas,
        "sync": dataclasses.asdict(layout.sync),
        "outer_bytes": sum(totals(messages).values()),
        "step_s": step,
        "tokens_per_s": tokens / step,
        "mfu": row["mfu"] * row["step_s"] / step,
    }


def exposed_s(row: dict) -> float:
    """A row's communication that compute does not hide, the outer step's included."""
    return row["comm_s"] - row["overlap_s"] + row.get("outer_exposed_s", 0.0)


def utilization(row: dict) -> float:
    return row["compute_s"] / (row["compute_s"] + exposed_s(row))


def solve_gbps(utilization_at: Callable[[float], float], target: float) -> float | None:
    """The least bandwidth (Gbit/s) at which `utilization_at` reaches `target`: 0.0 where any
    link does (nothing crosses it), None where none does (the fast links' exposed traffic
    alone misses it). Utilization grows with bandwidth; bisected on a log scale."""
    lo, hi = 1e-4, 1e7
    if utilization_at(lo) >= target:
        return 0.0
    if utilization_at(hi) < target:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if utilization_at(mid) < target else (lo, mid)
        if hi / lo < 1.0005:
            break
    return hi


def bandwidth_for(
    price_at: Callable[[Hardware], dict], hw: Hardware, target: float
) -> float | None:
    """Gbit/s per device of the slow link at which the layout `price_at` prices reaches
    compute utilization `target` (see solve_gbps for 0.0 and None)."""
    return solve_gbps(lambda gbps: utilization(price_at(with_slow_link(hw, gbps))), target)
