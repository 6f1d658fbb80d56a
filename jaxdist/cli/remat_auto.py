"""`--remat auto` wired: the model family's policies (models/remat.py), the planner's memory
model (models/inventory.py, jaxdist.planning.hostfit) and the device's memory, handed to
jaxdist.planning.fit; and, for a compile, the compiler's word on the choice."""

import dataclasses
import sys
from typing import NamedTuple

from jaxdist import hardware
from jaxdist.errors import ConfigError
from jaxdist.planning.fit import USABLE, RematChoice, choose


class Resolved(NamedTuple):
    config: object  # the model config with the chosen policy
    choice: RematChoice | None  # None where nothing could be weighed (unknown memory)


def order() -> tuple[str, ...]:
    """The policies from fastest to leanest."""
    from models import remat

    return tuple(getattr(remat, "ORDER", ("none", "dots", "full")))


def target_hardware(target: str) -> str:
    """The hardware preset of a --target (tpu-v5p:2x2x2 -> tpu-v5p, h100:8 -> h100)."""
    return target.split(":")[0]


def device_budget(mesh, target: str | None) -> float | None:
    """Bytes one device may plan for: a target's chip, an accelerator's own limit, or (fake
    CPU devices) this process's share of the host's available memory; None if unknown."""
    if target:
        return USABLE * hardware.get_hardware(target_hardware(target)).memory_bytes
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        from jaxdist.planning.hostfit import HEADROOM, available_bytes

        available = available_bytes()
        return HEADROOM * available / len(mesh.local_devices) if available else None
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return USABLE * stats["bytes_limit"]
    known = hardware.lookup(device)
    return USABLE * known.memory_bytes if known else None


def resolve(args, model_cfg, mesh, rules, target: str | None) -> Resolved:
    """The model config with the fastest policy predicted to fit; one line says which."""
    from jaxdist.planning.hostfit import device_bytes
    from models.inventory import plan_model

    budget = device_budget(mesh, target)
    policies = order()
    if budget is None:
        return Resolved(dataclasses.replace(model_cfg, remat=policies[0]), None)

    def peak_of(policy: str) -> float:
        config = dataclasses.replace(model_cfg, remat=policy)
        return device_bytes(plan_model(config), rules, dict(mesh.shape), args.batch_size, args.step)

    what = f"{model_cfg.name} at batch {args.batch_size} on {dict(mesh.shape)}"
    try:
        choice = choose(policies, peak_of, budget, what)
    except ConfigError:
        if mesh.devices.flat[0].platform != "cpu":
            raise
        # Fake CPU devices: the host-memory check (jaxdist.planning.hostfit) says it better.
        return Resolved(dataclasses.replace(model_cfg, remat=policies[-1]), None)
    if mesh.devices.flat[0].platform != "cpu" or choice.policy != policies[0]:
        print(choice.line(), file=sys.stderr)
    return Resolved(dataclasses.replace(model_cfg, remat=choice.policy), choice)
