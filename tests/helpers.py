"""Shared builders for tests: a model spec and a compiled step for a layout."""

import jax

from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.optim import OptimConfig, make_optimizer
from jaxdist.step import StepConfig, build
from meshes.presets import STANDARD_RULES, get_mesh_preset
from models.presets import get_model_config
from models.transformer import Transformer


def mesh_for(layout: str):
    if layout == "single":
        return build_mesh(get_mesh_preset("single").mesh, jax.devices()[:1])
    return build_mesh(parse_mesh(layout))


def compiled_for(
    layout: str,
    model: str = "tiny",
    batch_size: int = 16,
    microbatches: int = 1,
    steps: int = 10,
    **model_overrides,
):
    mc = get_model_config(model, **model_overrides)
    mesh = mesh_for(layout)
    tx, lr = make_optimizer(OptimConfig(warmup_steps=2), steps)
    compiled = build(
        lambda r: Transformer(mc, r),
        tx,
        lr,
        STANDARD_RULES,
        mesh,
        StepConfig(microbatches),
        seed=0,
        batch_size=batch_size,
    )
    return mc, mesh, compiled
