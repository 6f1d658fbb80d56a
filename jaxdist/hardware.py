"""The hardware table: one preset per device type, with everything jaxdist needs to know of it.

Peak FLOP/s (for MFU and the planner's compute time; FP8's beside bf16's where the chip has
FP8 units), memory per device, and the alpha-beta
costs of its links (for the cost model), plus the device-kind strings JAX reports for it, so a
running job finds its own preset. The figures, with their sources, are data: hardware.toml.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tomllib
from typing import TYPE_CHECKING

from jaxdist.errors import ConfigError

if TYPE_CHECKING:  # the table is read (plan, flags) without starting jax
    import jax


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
    # Substrings of jax's device_kind that name this hardware; none for simulated devices.
    kinds: tuple[str, ...] = ()
    # Share of overlappable communication (FSDP gathers, gradient reductions, pipeline sends)
    # the compiler hides behind compute: XLA:CPU runs collectives in line, GPU and TPU
    # schedulers run them async beside the matmuls.
    overlap: float = 0.0
    # The tensor-parallel exchanges overlappable too, at the same `overlap` share: a framework
    # that cuts each all-gather and reduce-scatter of the `tensor` axis into chunks and runs
    # them beside the GEMM that takes or makes them (Transformer Engine's userbuffers, NeMo's
    # ub_tp_comm_overlap). Off: XLA's GPU step, and jaxdist's, wait for them.
    tensor_overlap: bool = False
    # Per-device step-time jitter as a share of compute (kernel timing, clocks, host noise):
    # the straggler that every synchronous step waits for.
    jitter: float = 0.02
    # The compute term (jaxdist.planning.compute): HBM bytes/s for element-wise work; the share
    # of peak wide matmuls reach, and the width at which they reach half of it; the share fused
    # attention kernels reach.
    hbm_bandwidth: float = 0.0
    matmul_efficiency: float = 0.5
    matmul_half_width: float = 0.0
    attention_efficiency: float = 0.5
    # The passes frameworks make over element-wise tensors, as a multiple of the fused count
    # (jaxdist.planning.compute.ELEMENTWISE_PER_D): work that grows with d, not d^2.
    elementwise_passes: float = 1.0
    # Per device, FP8 dense (e4m3/e5m2 operands, as --fp8 runs the projections); 0: the chip
    # has no FP8 matmul units.
    fp8_peak_flops: float = 0.0
    # A Google Cloud slice name (v5p-16) this preset was asked for by; "" otherwise.
    slice_name: str = ""
    # A cloud GPU machine type (a3-highgpu-8g) this preset was asked for by; "" otherwise.
    machine: str = ""
    # What `outer` is: the link between hosts or slices (InfiniBand, DCN), its bandwidth per
    # device; replica groups (DiLoCo) meet over it.
    slow_link: str = ""

    @property
    def platform(self) -> str:
        return "cpu" if self.name == "cpu" else "tpu" if self.name.startswith("tpu") else "gpu"


def _table() -> dict[str, dict]:
    with (pathlib.Path(__file__).with_name("hardware.toml")).open("rb") as f:
        return tomllib.load(f)


def _load(table: dict[str, dict]) -> dict[str, Hardware]:
    """The device presets: the rows that name no `chip`."""
    return {
        name: Hardware(
            name=name,
            peak_flops=row["peak_flops"],
            memory_bytes=row["memory_bytes"],
            inner=Link(*row["inner"]),
            outer=Link(*row["outer"]),
            devices_per_host=row["devices_per_host"],
            about=row["about"],
            kinds=tuple(row["kinds"]),
            overlap=row["overlap"],
            jitter=row["jitter"],
            hbm_bandwidth=row["hbm_bandwidth"],
            matmul_efficiency=row["matmul_efficiency"],
            matmul_half_width=row["matmul_half_width"],
            attention_efficiency=row["attention_efficiency"],
            elementwise_passes=row.get("elementwise_passes", 1.0),
            fp8_peak_flops=row.get("fp8_peak_flops", 0.0),
            slow_link=row["slow_link"],
        )
        for name, row in table.items()
        if "chip" not in row
    }


def _machines(table: dict[str, dict]) -> dict[str, Hardware]:
    """The cloud machine types: their chip's preset with the machine's own figures (its network
    between hosts, its memory where the chip comes in two sizes). No device kinds: a running
    job finds the chip, not the machine."""
    machines = {}
    for name, row in table.items():
        if "chip" not in row:
            continue
        over = {k: Link(*v) if k in ("inner", "outer") else v for k, v in row.items()}
        chip = PRESETS[over.pop("chip")]
        machines[name] = dataclasses.replace(chip, machine=name, kinds=(), **over)
    return machines


_TABLE = _table()
PRESETS: dict[str, Hardware] = _load(_TABLE)
MACHINES: dict[str, Hardware] = _machines(_TABLE)
# Names earlier releases used for the same hardware.
_ALIASES = {"h100-nvlink": "h100", "h100-ib": "h100", "h200-nvlink": "h200"}


def slow_link_gbps(hw: Hardware) -> float:
    """The slow link's bandwidth (`outer`), Gbit/s per device and direction."""
    return hw.outer.bandwidth * 8 / 1e9


def with_slow_link(hw: Hardware, gbps: float) -> Hardware:
    """The preset with its slow link (`outer`) at `gbps` Gbit/s per device and direction, its
    latency kept: a cluster whose hosts, slices or buildings are joined by another network."""
    if not gbps > 0:
        raise ConfigError(
            f"--link-gbps {gbps}: the slow link's Gbit/s per device must be > 0 (e.g. 100 for "
            "a 400 Gb/s NIC shared by 4 devices)"
        )
    return dataclasses.replace(hw, outer=Link(hw.outer.alpha_s, gbps * 1e9 / 8))


def get_hardware(name: str) -> Hardware:
    """A preset by name; a cloud GPU machine type as its console names it (a3-highgpu-8g: 8
    H100s, 6.25 GB/s per GPU between hosts; the chip's preset keeps its name, so compile
    targets and device kinds still match); or a Google Cloud TPU slice (v5p-16: 8 chips of
    tpu-v5p), whose chips are then the preset's ICI domain: beyond it, slices talk over DCN."""
    name = _ALIASES.get(name, name)
    if name in PRESETS:
        return PRESETS[name]
    if name.lower() in MACHINES:  # Azure's console capitalizes (Standard_ND96isr_H100_v5)
        return MACHINES[name.lower()]
    found = cloud_slice(name)
    if found is None:
        raise ConfigError(
            f"unknown hardware {name!r}; choose one of: {', '.join(PRESETS)}; a cloud GPU "
            f"machine type ({', '.join(MACHINES)}); or a Google Cloud TPU slice such as "
            "v5p-16, v5e-256, v6e-8"
        )
    generation, chips = found
    return dataclasses.replace(
        PRESETS[f"tpu-{generation}"], devices_per_host=chips, slice_name=name
    )


# Google Cloud's accelerator types count TensorCores for v4 and v5p (two per chip) and chips
# for v5e (v5litepod in the console) and v6e: v5p-16 is 8 chips, v6e-8 is 8.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
_CLOUD = re.compile(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)")
_OLD = re.compile(r"tpu-(v4|v5p|v5e|v6e)-(\d+)")


def cloud_name(generation: str, chips: int) -> str:
    """Google Cloud's name of a slice of `chips` chips: 8 v5p chips are v5p-16."""
    return f"{generation}-{chips * _CORES_PER_CHIP[generation]}"


def cloud_slice(name: str) -> tuple[str, int] | None:
    """(generation, chips) of a Google Cloud accelerator type such as v5p-16 (8 chips); None
    for a name of another form; a ConfigError for one that cannot be a slice, or for
    jaxdist's old chip-counting names (tpu-v5p-64), which Google's would contradict."""
    old = _OLD.fullmatch(name)
    if old:
        generation, chips = old[1], int(old[2])
        raise ConfigError(
            f"{name}: jaxdist no longer names slices by chips; Google Cloud calls {chips} "
            f"{generation} chips {cloud_name(generation, chips)}: write that instead"
        )
    m = _CLOUD.fullmatch(name)
    if not m:
        return None
    generation = "v5e" if m[1] == "v5litepod" else m[1]
    count, per_chip = int(m[2]), _CORES_PER_CHIP[generation]
    chips = count // per_chip
    if count % per_chip or chips < 1 or chips & (chips - 1):
        unit = "TensorCores, 2 per chip" if per_chip == 2 else "chips"
        raise ConfigError(
            f"{name}: Google Cloud {generation} names count {unit}, and jaxdist plans slices "
            f"of a power of two chips; e.g. {cloud_name(generation, 8)} is 8 chips"
        )
    return generation, chips


# The share of a device's memory one program may hold. A TPU's figure in hardware.toml is
# already what its compiler makes available. On GPUs, what jaxdist lets XLA's allocator take
# (XLA_PYTHON_CLIENT_MEM_FRACTION, set by jaxdist.mesh.setup_devices where the user has not):
# the CUDA context, NCCL's buffers and cuDNN's handles live beside it. Fake CPU devices share
# the host with the runtime, the data and Python itself.
PROGRAM_SHARE = {"tpu": 1.0, "gpu": 0.9, "cpu": 0.9}


def budget(memory_bytes: float, platform: str) -> float:
    """Bytes one program may hold on a device of `memory_bytes` of this platform."""
    return PROGRAM_SHARE.get(platform, 0.9) * memory_bytes


def lookup(device: jax.Device) -> Hardware | None:
    """The preset of a real device, from the kind JAX reports; None where none matches."""
    kind = device.device_kind
    for hw in PRESETS.values():
        if any(k in kind for k in hw.kinds):
            return hw
    return None


def preset_name(device: jax.Device) -> str:
    """The cost-model preset for a device: its own, or the simulated `cpu` one."""
    hw = lookup(device)
    return hw.name if hw else "cpu"


def peak_flops(device: jax.Device, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device for MFU; None where unknown (CPUs), so MFU is not invented."""
    if override_tflops is not None:
        return override_tflops * 1e12
    hw = lookup(device)
    return hw.peak_flops if hw else None
