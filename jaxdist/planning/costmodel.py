"""Alpha-beta costs of collectives, hardware presets, and the fleet-law projection.

T(n) = alpha + n / beta per message step; ring collectives over p devices (n in the bytes
convention of jaxdist.comm: the full buffer):
  all-reduce      2(p-1) alpha + 2(p-1)/p n / B
  all-gather, reduce-scatter, all-to-all   (p-1) alpha + (p-1)/p n / B
  collective-permute   alpha + n / B
Small messages pay mostly alpha (latency-bound: bucket them); large ones n/B (bandwidth-bound:
shard or compress them).
"""

import dataclasses
import math

from jaxdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Link:
    alpha_s: float  # per message step
    bandwidth: float  # bytes/s per device per direction, as achieved by a good ring


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # per device, bf16 dense
    memory_bytes: float  # per device
    inner: Link  # inside a host or slice: NVLink, ICI
    outer: Link  # across hosts: InfiniBand, DCN
    devices_per_host: int
    about: str
    # Share of overlappable communication (FSDP gathers, gradient reductions, pipeline sends)
    # the compiler hides behind compute: XLA:CPU runs collectives in line, GPU and TPU
    # schedulers run them async beside the matmuls.
    overlap: float = 0.0
    # Per-device step-time jitter as a share of compute (kernel timing, clocks, host noise):
    # the straggler that every synchronous step waits for.
    jitter: float = 0.02


# Sources: NVIDIA datasheets (989 TFLOP/s bf16, NVLink 4 at 450 GB/s per direction, achieved
# all-reduce bus bandwidth ~370 GB/s); NCCL's tuning tables (~15 us ring latency on 8 GPUs);
# ConnectX-7 400 Gb/s = 50 GB/s per GPU; TPU v5p: 459 TFLOP/s, ICI 9e10 B/s per link one way,
# ~1 us per hop, DCN ~2.5e10 B/s per host. "cpu" simulates fake devices on one host, where a
# collective is a memory copy plus a rendezvous.
PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in [
        Hardware(
            "cpu",
            # Per fake device: 8 of them share the host's cores. experiments/strategies.py ran
            # tiny's data=8 step at ~50 GFLOP/s for the whole 2-core host, i.e. 6e9 per device
            # at the planner's default 50% efficiency.
            1.2e10,
            24e9,
            # Fitted by experiments/alpha_beta.py on 8 fake devices (2 cores): ~130 us per
            # collective whatever its kind (one rendezvous of the device threads, which the
            # ring form spreads over its steps) and 1.2-2 GB/s.
            Link(15e-6, 1.6e9),
            Link(15e-6, 1.6e9),
            1 << 30,
            "fake CPU devices on one host (simulated)",
            overlap=0.0,
            jitter=0.05,
        ),
        Hardware(
            "h100-nvlink",
            989e12,
            80e9,
            Link(15e-6, 370e9),
            Link(30e-6, 50e9),
            8,
            "H100 SXM, NVLink 4 inside 8-GPU hosts, InfiniBand NDR between",
            overlap=0.7,
            jitter=0.02,
        ),
        Hardware(
            "h200-nvlink",
            989e12,
            141e9,
            Link(15e-6, 370e9),
            Link(30e-6, 50e9),
            8,
            "H200 SXM (H100's NVLink 4, 141 GB HBM3e)",
            overlap=0.7,
            jitter=0.02,
        ),
        Hardware(
            "h100-ib",
            989e12,
            80e9,
            Link(15e-6, 370e9),
            Link(30e-6, 50e9),
            8,
            "H100 hosts of 8 over InfiniBand NDR 400 Gb/s per GPU",
            overlap=0.7,
            jitter=0.02,
        ),
        Hardware(
            "tpu-v5p",
            459e12,
            95e9,
            Link(1e-6, 2 * 9e10),
            Link(30e-6, 2.5e10 / 4),
            4096,
            "TPU v5p: 3D torus ICI within a slice, DCN between slices",
            overlap=0.9,
            jitter=0.01,
        ),
        Hardware(
            "tpu-v5e",
            197e12,
            16e9,
            Link(1e-6, 2 * 4.5e10),
            Link(30e-6, 2.5e10 / 4),
            256,
            "TPU v5e: 2D torus ICI",
            overlap=0.9,
            jitter=0.01,
        ),
    ]
}


def get_hardware(name: str) -> Hardware:
    if name in PRESETS:
        return PRESETS[name]
    base = name.rsplit("-", 1)[0]  # tpu-v5p-64 -> tpu-v5p
    if base in PRESETS and name.rsplit("-", 1)[1].isdigit():
        return PRESETS[base]
    raise ConfigError(f"unknown hardware {name!r}; choose one of: {', '.join(PRESETS)}")


def collective_time(kind: str, nbytes: float, p: int, link: Link) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all-reduce":
        return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes / link.bandwidth
    if kind in ("all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return (p - 1) * link.alpha_s + (p - 1) / p * nbytes / link.bandwidth
    return link.alpha_s + nbytes / link.bandwidth  # collective-permute, send/recv


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
    return math.prod(mesh_shape.get(a, 1) for a in axes_label.split("+"))
