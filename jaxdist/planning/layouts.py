"""The layouts the planner considers: every split of N devices over the mesh axes it may use, as
jaxdist.layout.Layout values, and why one cannot run a model (refused before anything is
priced)."""

import dataclasses

from flax import nnx
from jax.sharding import AbstractMesh

from jaxdist.errors import ConfigError
from jaxdist.layout import MESH_AXES, REPLICA, AxisRules, Layout, Problem
from jaxdist.parallel import schedules
from jaxdist.planning.inputs import PlanConfig, PlanModel
from jaxdist.rules import check_divisible, logical_axes


def factorizations(n: int, axes: tuple[str, ...], replicas: int = 0) -> list[dict[str, int]]:
    """Every way to split n devices over `axes` (their sizes multiply to n); `replicas`, where
    given, the one size of a `replica` axis beside 1."""
    if not axes:
        return [{}] if n == 1 else []
    out = []
    for size in range(1, n + 1):
        if n % size == 0 and not (axes[0] == REPLICA and replicas and size not in (1, replicas)):
            for rest in factorizations(n // size, axes[1:]):
                out.append({axes[0]: size, **rest})
    return out


def layout_of(
    sizes: dict[str, int], rules: AxisRules, cfg: PlanConfig, seq_len: int, remat: str = ""
) -> Layout:
    """The Layout of a split: every mesh axis (1 where the split leaves it out), the step's
    settings with its microbatches as the step will run them (as asked; where the step asks
    for 1 on a pipelined split, 4 per stage, which keeps the stages busy), and with a
    `replica` axis, the plan's sync settings."""
    stages = sizes.get("pipeline", 1)
    step = cfg.step
    if step.microbatches == 1 and stages > 1:
        step = dataclasses.replace(step, microbatches=4 * stages)
    full = tuple((a, sizes.get(a, 1)) for a in MESH_AXES)
    groups = cfg.sync if sizes.get(REPLICA, 1) > 1 else None  # how a replica axis's groups meet
    return Layout(full, rules, step, remat, cfg.batch_size, seq_len, groups)


def abstract_mesh(layout: Layout) -> AbstractMesh:
    """The layout as a mesh without devices, over every mesh axis."""
    shape = layout.mesh_shape
    return AbstractMesh(tuple(shape.get(a, 1) for a in MESH_AXES), MESH_AXES)


def why_not(layout: Layout, model: PlanModel, hw) -> Problem | None:
    """The reason a layout cannot run this model, or None: the layout's own problems (the
    ones the step refuses, counted here by kind), its pipeline schedule's, and what the model
    and the machine add. Replica groups: each group's layout, at its block of the batch."""
    problems = layout.problems(model.num_layers)
    if problems:
        return problems[0]
    if layout.grouped:
        layout = layout.group_alone()
    shape = layout.mesh_shape
    if shape.get("tensor", 1) > hw.devices_per_host:
        return _plain("tensor axis wider than a host")
    if shape.get("expert", 1) > 1 and not model.num_experts:
        return _plain("expert axis on a dense model")
    stages, v = layout.stages, layout.virtual_stages
    if stages > 1 and layout.microbatches < stages:
        return _plain(
            "fewer microbatches than pipeline stages"
        )  # gpipe would run them, mostly idle
    try:
        schedules.for_layout(layout)
    except ConfigError:
        return _plain("microbatches do not fit the pipeline schedule")
    if stages > 1 and model.num_layers % (stages * v):
        return _plain("layers do not split over the pipeline stages")
    mesh = abstract_mesh(layout)
    for path, var in nnx.to_flat_state(model.abstract_params):
        logical = logical_axes(var)
        what = "/".join(map(str, path))
        try:
            for kind in ("param", "activation"):
                spec = layout.rules.spec(logical, kind)
                check_divisible(what, var.shape, logical, spec, mesh)
        except ConfigError:
            return _plain("a weight does not split evenly")
    return None


def _plain(kind: str) -> Problem:
    """A reason the planner alone gives: its kind is its whole message."""
    return Problem(kind, kind)
