"""`--remat auto` wired: the model family's policies (models/remat.py), the one price of a step's
memory (models/inventory.py's view of the model, jaxdist.planning.memory.device_peak) and the
device's memory, handed to the one chooser (jaxdist.planning.fit.choose)."""

import dataclasses
import sys

from jaxdist import hardware
from jaxdist.errors import ConfigError
from jaxdist.planning import fit


def order() -> tuple[str, ...]:
    """The policies from fastest to leanest."""
    from models import remat

    return remat.ORDER


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
        from jaxdist.planning.hostfit import available_bytes

        available = available_bytes()
        return available / len(mesh.local_devices) if available else None
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return stats["bytes_limit"]
    known = hardware.lookup(device)
    return known.memory_bytes if known else None


def choose(model_cfg, layout, memory_bytes: float, platform: str) -> fit.RematChoice:
    """The fastest policy of the model family whose step on `layout` is predicted to fit."""
    from jaxdist.planning.memory import device_peak
    from models.inventory import plan_model

    def peak_of(policy: str) -> float:
        model = plan_model(dataclasses.replace(model_cfg, remat=policy))
        return device_peak(model, dataclasses.replace(layout, remat=policy), platform)["peak"]

    return fit.choose(order(), peak_of, memory_bytes, platform)


def resolve(model_cfg, layout, mesh, target: str | None, platform: str):
    """The model config with the fastest policy predicted to fit; one line says which."""
    memory = device_memory(mesh, target)
    if memory is None:
        return dataclasses.replace(model_cfg, remat=order()[0])
    choice = choose(model_cfg, layout, memory, platform)
    leanest = choice.predicted[choice.policy]
    if not choice.fits and platform != "cpu" and leanest > memory:
        raise ConfigError(
            f"{model_cfg.name} at batch {layout.batch_size} on {layout.describe()} does not fit "
            f"at any rematerialization policy: the leanest ({choice.policy}) needs about "
            f"{leanest / 1e9:.1f} GB per device, the device has {memory / 1e9:.1f} GB; use a "
            "smaller --batch-size, more devices, or a mesh that shards more of the model "
            "(fsdp, tensor, pipeline)"
        )
    # Fake CPU devices that do not fit: the host-memory check (jaxdist.planning.hostfit) says
    # it better, next. Past the usable share but within the device: the compiler decides.
    if platform != "cpu" or (choice.fits and choice.policy != order()[0]):
        print(choice.line(), file=sys.stderr)
    return dataclasses.replace(model_cfg, remat=choice.policy)
