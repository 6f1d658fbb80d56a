"""Device meshes: parse a layout, make the devices exist, and build a mesh that uses all of them.

The mesh always carries every axis in MESH_AXES (size 1 where a layout leaves one out), so a
rule table can name any axis under any layout and a layout change is one flag.
"""

import dataclasses
import glob
import math
import os

import jax
from jax.sharding import AxisType, Mesh

from jaxdist.errors import ConfigError
from jaxdist.hardware import PROGRAM_SHARE

# Outermost first: slow links (pipeline stages across racks, data across hosts) outside,
# fast links (tensor) innermost; context (K/V exchanged every layer) and expert all-to-all
# traffic sit on fast links too. `replica` is outermost of all: groups that train alone and
# meet only every H steps (jaxdist.parallel.replica) belong across the slowest link.
REPLICA = "replica"
MESH_AXES: tuple[str, ...] = (
    *(REPLICA, "pipeline", "data", "fsdp", "context", "expert", "tensor"),
)
# The axes a layout is searched over by default: every one but `replica`, whose groups change
# what is computed (DiLoCo), not only where; the planner ranks it when asked.
SEARCHED_AXES: tuple[str, ...] = tuple(a for a in MESH_AXES if a != REPLICA)


def spec(shape) -> str:
    """Mesh sizes ({axis: size}) as --mesh takes them, the size-1 axes left out."""
    return ",".join(f"{a}={n}" for a, n in dict(shape).items() if n > 1) or "single"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes per mesh axis; `dcn` holds the part of each axis that spans hosts or slices."""

    ici: tuple[tuple[str, int], ...]
    dcn: tuple[tuple[str, int], ...] = ()

    def sizes(self) -> dict[str, int]:
        ici, dcn = dict(self.ici), dict(self.dcn)
        return {a: ici.get(a, 1) * dcn.get(a, 1) for a in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes().values())

    def describe(self) -> str:
        return spec(self.sizes())


def parse_mesh(text: str) -> MeshConfig:
    """Parses an inline layout such as `data=2,fsdp=2,tensor=2`; one axis may be -1 (the rest)."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            raise ConfigError(
                f"mesh entry {part!r} is not axis=size; write e.g. --mesh data=2,fsdp=2,tensor=2"
            )
        if name not in MESH_AXES:
            raise ConfigError(
                f"unknown mesh axis {name!r} in --mesh {text!r}; known axes: {', '.join(MESH_AXES)}"
            )
        if name in sizes:
            raise ConfigError(f"mesh axis {name!r} given twice in --mesh {text!r}")
        try:
            size = int(value)
        except ValueError:
            raise ConfigError(f"mesh axis {name}={value!r} is not an integer") from None
        if size == 0 or size < -1:
            raise ConfigError(f"mesh axis {name}={size} must be a positive size (or -1 for rest)")
        sizes[name] = size
    if sum(1 for n in sizes.values() if n == -1) > 1:
        raise ConfigError(f"at most one mesh axis may be -1 in --mesh {text!r}")
    return MeshConfig(ici=tuple(sizes.items()))


def resolve_fill(config: MeshConfig, num_devices: int) -> MeshConfig:
    """Replaces a -1 axis size with whatever the other axes leave of `num_devices`."""
    ici = dict(config.ici)
    fill = [a for a, n in ici.items() if n == -1]
    if not fill:
        return config
    known = math.prod(n for n in ici.values() if n != -1) * math.prod(n for _, n in config.dcn)
    if num_devices % known:
        raise ConfigError(
            f"mesh {ici} cannot fill {num_devices} devices: {num_devices} is not divisible by "
            f"{known}; pick axis sizes whose product divides the device count"
        )
    ici[fill[0]] = num_devices // known
    return dataclasses.replace(config, ici=tuple(ici.items()))


def _accelerator_present() -> bool:
    """A TPU (accel or vfio devices), NVIDIA or AMD GPU device file on this host."""
    patterns = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
    return any(glob.glob(p) for p in patterns)


def setup_devices(spec: str) -> None:
    """Makes `--devices` true before JAX starts its backends.

    `cpu:N` gives N fake CPU devices (collectives run in-process); `auto` uses the accelerators
    present and, on a host with none, 8 fake CPU devices. Must run before anything touches
    jax.devices(), since backends start once per process.
    """
    started = jax._src.xla_bridge.backends_are_initialized()  # noqa: SLF001 - no public query
    if spec == "auto":
        if not started:
            # On GPUs XLA's allocator takes this share of each device (JAX's default is 0.75):
            # the share the planner, --remat auto and --compile-only call a program's budget
            # (jaxdist.hardware.PROGRAM_SHARE), so what they say fits, fits. A user's own
            # setting wins.
            os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(PROGRAM_SHARE["gpu"]))
            # Only the CPU backend reads this, so it is harmless where accelerators exist.
            jax.config.update("jax_num_cpu_devices", 8)
            if not os.environ.get("JAX_PLATFORMS") and not _accelerator_present():
                # A plugin installed beside jax (libtpu, CUDA) would start, fail to find its
                # device and print pages of warnings on every CPU run: do not start it.
                jax.config.update("jax_platforms", "cpu")
        return
    platform, _, count = spec.partition(":")
    if platform != "cpu" or not count.isdigit() or int(count) < 1:
        raise ConfigError(
            f"--devices {spec!r} is not understood; use cpu:N (N fake CPU devices) or auto"
        )
    n = int(count)
    if started:
        have = jax.device_count()
        if jax.default_backend() != "cpu" or have != n:
            raise ConfigError(
                f"--devices {spec} asked for after JAX already started with {have} "
                f"{jax.default_backend()} devices; set it before any JAX work"
            )
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def _across(processes: int) -> str:
    return f" ({processes} processes together)" if processes > 1 else ""


def devices_hint(needed: int, processes: int = 1) -> str:
    """The --devices that gives a mesh `needed` devices: cpu:N is per process, so N is the
    mesh's share of each of the run's `processes`."""
    if processes == 1:
        return f"--devices cpu:{needed} on a CPU host"
    if needed % processes:
        return (
            f"on a CPU host a mesh whose size divides over the {processes} processes "
            f"(--devices cpu:N gives each N)"
        )
    return (
        f"--devices cpu:{needed // processes} on a CPU host (per process: {processes} "
        f"processes x {needed // processes} = {needed})"
    )


def make_mesh(layout: str, devices: list | None = None) -> Mesh:
    """A mesh from a layout string such as `data=2,fsdp=2,tensor=2` over `devices` (all by
    default); `single` is one device."""
    if layout == "single":
        return build_mesh(MeshConfig(ici=()), list(devices or jax.devices())[:1])
    return build_mesh(parse_mesh(layout), devices)


def build_mesh(config: MeshConfig, devices: list | None = None) -> Mesh:
    """A mesh over exactly `devices` (all of them by default), or a ConfigError saying why not."""
    devices = list(jax.devices() if devices is None else devices)
    config = resolve_fill(config, len(devices))
    if config.num_devices != len(devices):
        processes = jax.process_count()
        raise ConfigError(
            f"mesh {config.describe()} needs {config.num_devices} devices but "
            f"{len(devices)} are present{_across(processes)}; change --mesh so the sizes "
            f"multiply to {len(devices)}, or {devices_hint(config.num_devices, processes)}"
        )
    sizes = config.sizes()
    shape = tuple(sizes[a] for a in MESH_AXES)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if config.dcn and any(n > 1 for _, n in config.dcn):
        from jax.experimental import mesh_utils

        ici, dcn = dict(config.ici), dict(config.dcn)
        grid = mesh_utils.create_hybrid_device_mesh(
            [ici.get(a, 1) for a in MESH_AXES], [dcn.get(a, 1) for a in MESH_AXES], devices
        )
        return Mesh(grid, MESH_AXES, axis_types=axis_types)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
        # A TPU torus whose extents do not factor into the axis sizes (2x32 on 4x4x4): split
        # physical axes, at the price of some rings that wrap less neatly.
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)
