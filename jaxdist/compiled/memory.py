"""A compiled step's memory and the device's it must fit: XLA's own peak of the program
(`xla_peak`), and the bytes of the device it runs on or is compiled for (`device_memory`)."""

from jaxdist import hardware
from jaxdist.planning.hostfit import available_bytes


def xla_peak(stats) -> int:
    """XLA's own per-device figure from a compiled step's memory analysis: arguments, outputs
    and temporaries, with donated state (aliased to its output) counted once."""
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def target_hardware(target: str) -> str:
    """The hardware preset of a --target (tpu-v5p:2x2x2 -> tpu-v5p, h100:8 -> h100, v5p-16 ->
    v5p-16, whose chips are tpu-v5p's)."""
    return target.split(":")[0]


def device_memory(mesh, target: str | None) -> float | None:
    """Bytes of one device: a target's chip, an accelerator's own limit, or (fake CPU devices)
    this process's share of the host's available memory; None if unknown."""
    if target:
        return hardware.get_hardware(target_hardware(target)).memory_bytes
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        available = available_bytes()
        return available / len(mesh.local_devices) if available else None
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return stats["bytes_limit"]
    known = hardware.lookup(device)
    return known.memory_bytes if known else None
