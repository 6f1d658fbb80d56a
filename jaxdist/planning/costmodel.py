"""Alpha-beta costs of collectives and the fleet-law projection (presets: jaxdist.hardware).

T(n) = alpha + n / beta per message step; ring collectives over p devices (n in the bytes
convention of jaxdist.planning.traffic: the full buffer):
  all-reduce      2(p-1) alpha + 2(p-1)/p n / B
  all-gather, reduce-scatter, all-to-all   (p-1) alpha + (p-1)/p n / B
  collective-permute   alpha + n / B
Small messages pay mostly alpha (latency-bound: bucket them); large ones n/B (bandwidth-bound:
shard or compress them). Over many devices the ring's 2(p-1) latency steps dominate; NCCL then
switches all-reduce to its double binary tree, 2 log2(p) alpha + 2 n / B, and an all-reduce is
priced as the faster of the two.
"""

import math

from jaxdist.hardware import Hardware, Link
from jaxdist.layout import ways


def collective_time(kind: str, nbytes: float, p: int, link: Link) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all-reduce":
        ring = 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes / link.bandwidth
        tree = 2 * math.ceil(math.log2(p)) * link.alpha_s + 2 * nbytes / link.bandwidth
        return min(ring, tree)
    if kind in ("all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return (p - 1) * link.alpha_s + (p - 1) / p * nbytes / link.bandwidth
    return link.alpha_s + nbytes / link.bandwidth  # collective-permute, send/recv


def spanning_time(kind: str, nbytes: float, group: int, stride: int, hw: Hardware) -> float:
    """A collective over `group` devices `stride` apart. Inside one host (or TPU slice) it runs
    on the inner links; spanning several, NCCL and XLA run it in two levels: over the k members
    each host holds (inner links), then across hosts with 1/k of the buffer per member (outer
    links: InfiniBand, DCN), every member's share in parallel. All-to-all and sends pay the
    outer link for everything."""
    if group * stride <= hw.devices_per_host:
        return collective_time(kind, nbytes, group, hw.inner)
    k = min(group, max(1, hw.devices_per_host // stride))
    while group % k:
        k -= 1
    if k == 1 or kind not in ("all-reduce", "all-gather", "reduce-scatter"):
        return collective_time(kind, nbytes, group, hw.outer)
    across = group // k
    if kind == "all-reduce":  # reduce-scatter inside, all-reduce across, all-gather inside
        inside = 2 * collective_time("reduce-scatter", nbytes, k, hw.inner)
    else:
        inside = collective_time(kind, nbytes, k, hw.inner)
    return inside + collective_time(kind, nbytes / k, across, hw.outer)


def link_for(hw: Hardware, group_size: int, stride: int) -> Link:
    """A group of `group_size` devices `stride` apart stays on inner links while it fits a host."""
    return hw.inner if group_size * stride <= hw.devices_per_host else hw.outer


def project(
    compute_s: float,
    grad_bytes: float,
    overlap_fraction: float,
    sync_fraction: float,
    devices_now: int,
    hw: Hardware,
    max_devices: int = 4096,
) -> list[dict]:
    """The fleet law for this step's work spread over N devices at a fixed global batch:

        T_step(N) = T_compute/N + T_comm(N) + T_sync(N) - T_overlap(N)

    T_compute from the measured per-device compute; T_comm the gradient all-reduce of the
    measured gradient bytes over N (inner links within a host, outer beyond); overlap and sync
    held at their measured shares of communication. A projection, not a measurement.
    """
    total_compute = compute_s * devices_now
    out = []
    n = 1
    while n <= max_devices:
        t_comp = total_compute / n
        t_comm = collective_time("all-reduce", grad_bytes, n, link_for(hw, n, 1))
        t_overlap = min(t_comp, overlap_fraction * t_comm)
        t_sync = sync_fraction * t_comm
        t_step = t_comp + t_comm + t_sync - t_overlap
        out.append(
            {
                "devices": n,
                "compute_s": t_comp,
                "comm_s": t_comm,
                "sync_s": t_sync,
                "overlap_s": t_overlap,
                "step_s": t_step,
            }
        )
        n *= 2
    t1 = out[0]["step_s"]
    for row in out:
        row["efficiency"] = t1 / (row["devices"] * row["step_s"]) if row["step_s"] else None
    return out


def comm_dominates_at(projection: list[dict]) -> int | None:
    """The smallest N where exposed communication and sync exceed compute: the fleet's wall."""
    for row in projection:
        if row["comm_s"] + row["sync_s"] - row["overlap_s"] > row["compute_s"]:
            return row["devices"]
    return None


def ring_bytes_factor(kind: str, p: int) -> float:
    """Bytes each device sends per byte of buffer, for achieved bus bandwidth."""
    if p <= 1:
        return 0.0
    return (
        2 * (p - 1) / p
        if kind == "all-reduce"
        else (p - 1) / p
        if kind != "collective-permute"
        else 1.0
    )


def group_size(mesh_shape: dict[str, int], axes_label: str) -> int:
    if axes_label in ("unknown", "none", ""):
        return 0
    return ways(mesh_shape, axes_label.split("+"))
