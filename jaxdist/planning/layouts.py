"""The layouts the planner considers: every split of N devices over the mesh axes it may use,
and why a split cannot run a model (refused before anything is priced)."""

from typing import TYPE_CHECKING

from flax import nnx
from jax.sharding import AbstractMesh

from jaxdist.errors import ConfigError
from jaxdist.mesh import MESH_AXES
from jaxdist.rules import AxisRules, check_divisible, logical_axes, ways

if TYPE_CHECKING:  # the planner's own types; it imports this module
    from jaxdist.planning.planner import PlanConfig, PlanModel


def factorizations(n: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Every way to split n devices over `axes` (their sizes multiply to n)."""
    if not axes:
        return [{}] if n == 1 else []
    out = []
    for size in range(1, n + 1):
        if n % size == 0:
            for rest in factorizations(n // size, axes[1:]):
                out.append({axes[0]: size, **rest})
    return out


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """The layout as a mesh without devices, over every mesh axis."""
    return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)


def describe(sizes: dict[str, int]) -> str:
    """The layout as `--mesh` takes it (fsdp=2,context=4), its size-1 axes left out."""
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if sizes.get(a, 1) > 1) or "single"


def microbatches(cfg: "PlanConfig", stages: int) -> int:
    """Microbatches per step: as asked, else 1 without a pipeline and 4 per stage with one."""
    if cfg.microbatches:
        return cfg.microbatches
    return 1 if stages == 1 else 4 * stages


def why_not(
    sizes: dict[str, int], model: "PlanModel", rules: AxisRules, cfg: "PlanConfig", hw
) -> str | None:
    """The reason a layout cannot run this model, or None."""
    mesh = abstract_mesh(sizes)
    if sizes.get("tensor", 1) > hw.devices_per_host:
        return "tensor axis wider than a host"
    if sizes.get("expert", 1) > 1 and not model.num_experts:
        return "expert axis on a dense model"
    stages = sizes.get("pipeline", 1)
    m = microbatches(cfg, stages)
    n = ways(sizes, rules.mesh_axes("batch", "activation"))
    if cfg.batch_size % (m * n):
        return f"batch {cfg.batch_size} not divisible by {m} microbatches x {n} batch ways"
    cp = ways(sizes, rules.mesh_axes("seq", "activation"))
    if cp > 1 and model.seq_len % (2 * cp):
        return "sequence not a multiple of 2 x context (each device holds two equal chunks)"
    if stages > 1 and m < stages:
        return f"{m} microbatches fewer than {stages} stages"
    v = cfg.virtual_stages if cfg.schedule == "interleaved" else 1
    if stages > 1 and (model.num_layers % (stages * v) or (v > 1 and m % stages)):
        return f"layers or microbatches do not split into {stages} x {v} interleaved chunks"
    for path, var in nnx.to_flat_state(model.abstract_params):
        logical = logical_axes(var)
        try:
            check_divisible(
                "/".join(map(str, path)), var.shape, logical, rules.spec(logical, "param"), mesh
            )
            check_divisible(
                "/".join(map(str, path)),
                var.shape,
                logical,
                rules.spec(logical, "activation"),
                mesh,
            )
        except ConfigError:
            return "a weight does not split evenly"
    return None
