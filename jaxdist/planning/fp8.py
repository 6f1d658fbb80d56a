"""FP8 in the plan (`--fp8 current|delayed`): which GEMMs the model runs on FP8 operands, and
what the layout gains over the same layout in the compute dtype.

The projections of attention and the MLP, each where jaxdist.kernels.fp8.projection_recipe
runs it in FP8 (the model's own rule; `--fp8-filter none`: all of them), run their forward and
both backward GEMMs at the hardware's FP8 peak, scaled by the same efficiency curve as bf16's
(planning.compute: one rate per GEMM shape, from the peak its operands run at), and pay for
casting their operands (planning.compute.fp8_cast_bytes). The head, attention's own products
and MoE's experts stay in the compute dtype, as the model keeps them. Not priced: the amax's
all-reduce over the batch axes (a scalar per tensor: latency, not bytes), and any memory the
FP8 copies add.
"""

import dataclasses

from jaxdist.hardware import Hardware
from jaxdist.kernels.fp8 import no_fp8_units, projection_recipe
from jaxdist.layout import Layout
from jaxdist.planning.compute import Matmul, Work


def projections(work: Work) -> list[Matmul]:
    """The matmuls --fp8 may quantize: every layer's own, not the head's or an expert's."""
    return [m for m in work.matmuls if m.in_layers and not m.expert]


def _admitted(m: Matmul, step) -> bool:
    """Whether the model runs this projection in FP8 (the kernel's rule on its d_in, d_out)."""
    d_in, d_out = (m.embed, m.other) if m.embed_in else (m.other, m.embed)
    return projection_recipe(step, d_in, d_out) != "off"


def admit(work: Work, layout: Layout, hw: Hardware) -> Work:
    """The work with the projections the step runs in FP8 marked (none with --fp8 off). A
    ConfigError where the hardware has no FP8 matmul units (kernels.fp8.no_fp8_units)."""
    step = layout.step
    if step.fp8 == "off":
        return work
    if not hw.fp8_peak_flops:
        why = "jaxdist/hardware.toml gives it no fp8_peak_flops"
        raise no_fp8_units(step.fp8, hw.name, why, "drop --fp8, or plan for h100 or h200")
    eligible = set(map(id, projections(work)))
    matmuls = tuple(
        dataclasses.replace(m, fp8=True) if id(m) in eligible and _admitted(m, step) else m
        for m in work.matmuls
    )
    return dataclasses.replace(work, matmuls=matmuls)


def without(layout: Layout) -> Layout:
    """The same layout with every GEMM in the compute dtype."""
    return dataclasses.replace(layout, step=dataclasses.replace(layout.step, fp8="off"))


def comparison(work: Work, row: dict, bf16: dict) -> dict:
    """A row's FP8 figures beside the same layout's priced in the compute dtype: the recipe's
    projections admitted, the predicted speedup of the step and its compute."""
    admitted = [m for m in projections(work) if m.fp8]
    return {
        "projections": len(admitted),
        "of": len(projections(work)),
        "speedup": bf16["step_s"] / row["step_s"],
        "compute_speedup": bf16["compute_s"] / row["compute_s"],
        "bf16_step_s": bf16["step_s"],
        "cast_s": row["compute_by_kind"]["fp8_cast"],
    }
