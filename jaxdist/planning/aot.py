"""Ahead-of-time: compile the real train step for abstract inputs, on the devices present or on
a target this host does not have (jaxdist.planning.tpu, jaxdist.planning.gpu), and read XLA's
own figures: memory per device and the collectives per mesh axis. Nothing is allocated and
nothing runs, so a layout that cannot fit is found before the fleet is rented.

What compiling without the device cannot see, where it matters:
- cuDNN's own graph is not built: its workspace is missing from the temporaries, and whether
  cuDNN accepts a shape is only checked on a GPU;
- there is no autotuning, so kernel counts are approximate (the GEMM tiling cost model stands
  in, --xla_gpu_experimental_cost_model_gemm_tiling_default);
- JAX's attention checks consult the CPU backend (it refuses head dim 256, which an H100
  allows);
- a multi-host GPU topology puts every device in one slice, so hosts are told apart by process
  index;
- the TPU compiler's memory_analysis() counts beyond its own buffer assignment (the planner's
  tpu_copies, jaxdist.planning.memory).
On a real GPU, XLA writes the config it compiled for beside each dumped module
(XLA_FLAGS=--xla_dump_to=DIR: *.gpu_target_config.pbtxt), the one to check
planning/gpu_targets/ against (experiments/h200.py saves it).
"""

import dataclasses
import math
import re
import time

import numpy as np

from jaxdist.hardware import get_hardware
from jaxdist.mesh import MeshConfig, build_mesh
from jaxdist.model import ModelSpec
from jaxdist.optim import OptimConfig, make_optimizer
from jaxdist.parallel.pipeline import branch_share, make_schedule
from jaxdist.planning import hlo, kernels
from jaxdist.planning.memory import xla_peak
from jaxdist.rules import AxisRules
from jaxdist.step import JittedStep, StepConfig, build

MEMORY_TOLERANCE = 0.15  # predicted vs XLA's per-device memory
BYTES_TOLERANCE = 0.05  # predicted vs the compiled HLO's collective bytes


def compile_only(jitted: JittedStep, batch_size: int, seq_len: int) -> dict:
    """XLA's per-device memory analysis, collectives and cost analysis of the step."""
    t0 = time.perf_counter()
    exe = jitted.compile_abstract((batch_size, seq_len + 1))
    seconds = time.perf_counter() - t0
    mem = exe.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    per_device = {f.removesuffix("_size_in_bytes"): getattr(mem, f, 0) for f in fields}
    per_device["peak_estimate"] = xla_peak(mem)
    mesh = jitted.batch_sharding.mesh
    text = exe.as_text()
    collectives = hlo.summarize(hlo.collectives(text, dict(mesh.shape)))
    platform = mesh.devices.flat[0].platform
    accelerator = {"kernels": kernels.analyze(text, seq_len)} if platform in ("gpu", "tpu") else {}
    hosts = np.vectorize(lambda d: d.process_index)(mesh.devices)
    if hosts.max() > 0:
        # Axes whose neighbours sit on other hosts: their collectives cross the network.
        accelerator["axes_across_hosts"] = [
            a for i, a in enumerate(mesh.axis_names) if (np.diff(hosts, axis=i) != 0).any()
        ]
    return {
        "compile_s": seconds,
        "platform": platform,
        "device_kind": mesh.devices.flat[0].device_kind,
        "per_device_bytes": per_device,
        "collectives": [
            {"axis": axis, "kind": kind, **v} for (axis, kind), v in sorted(collectives.items())
        ],
        **accelerator,
    }


def target_fit(hardware: str, report: dict, model: ModelSpec, batch_size: int, devices: int):
    """Whether the step fits a chip of the target, and the model's FLOPs per device."""
    hw = get_hardware(hardware)
    ours = model.flops_per_token * batch_size * model.seq_len / devices
    peak = report["per_device_bytes"]["peak_estimate"]
    out = {
        "chip_memory_bytes": hw.memory_bytes,
        "peak_gib": round(peak / 2**30, 2),
        "chip_gib": round(hw.memory_bytes / 2**30, 2),
        "fits": peak <= hw.memory_bytes,
        # No XLA FLOP count beside it: XLA's cost analysis counts a loop's body once, so the
        # layer scan's FLOPs came out at 1/L of the step's (a ratio of 0.035-0.054 on 7B).
        "model_flops_per_device": ours,
    }
    if "kernels" in report:
        attention = getattr(model.config, "attention", None)
        out["attention_kernel"] = kernels.attention_kernel(
            report["kernels"], report["platform"], attention
        )
        out["warnings"] = kernels.warnings(report | out, hw.memory_bytes)
    return out


def verify(
    row: dict,
    model: ModelSpec,
    rules: AxisRules,
    batch_size: int,
    step: StepConfig,
    devices: list,
) -> dict:
    """Compiles a planned layout's real train step for abstract inputs on `devices` and sets
    XLA's memory and the HLO's collective bytes beside the planner's predictions. `step`: the
    step's settings but its microbatches, which are the layout's."""
    mesh = build_mesh(MeshConfig(ici=tuple(row["mesh"].items())), devices)
    tx, lr = make_optimizer(OptimConfig(), 100)
    step = dataclasses.replace(step, microbatches=row["microbatches"])
    t0 = time.perf_counter()
    jitted = build(model.init, tx, lr, rules, mesh, step, 0, batch_size, seq_len=model.seq_len)
    try:
        exe = jitted.compile_abstract((batch_size, model.seq_len + 1))
    except Exception as e:  # the TPU compiler refuses a step that cannot fit the chip
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return _refused(row, str(e), devices, time.perf_counter() - t0)
    mem = exe.memory_analysis()
    peak = xla_peak(mem)
    share = None
    if mesh.shape.get("pipeline", 1) > 1:  # the tick's branches run on their own ticks only
        sched = make_schedule(
            step.pipeline_schedule, mesh.shape["pipeline"], step.microbatches, step.virtual_stages
        )
        share = branch_share(sched)
    measured = hlo.summarize(hlo.collectives(exe.as_text(), dict(mesh.shape), share))
    hlo_bytes = sum(v["bytes"] for v in measured.values())
    predicted_mem = row["memory_bytes"]["peak"]
    predicted_bytes = row["comm_bytes"]
    mem_ratio = predicted_mem / peak if peak else math.nan
    bytes_ratio = predicted_bytes / hlo_bytes if hlo_bytes else (1.0 if not predicted_bytes else 0)
    return {
        "platform": devices[0].platform,
        "compile_s": time.perf_counter() - t0,
        "xla_peak_bytes": peak,
        "xla_temp_bytes": mem.temp_size_in_bytes,
        "predicted_peak_bytes": predicted_mem,
        "memory_ratio": mem_ratio,
        "hlo_collective_bytes": hlo_bytes,
        "predicted_collective_bytes": predicted_bytes,
        "bytes_ratio": bytes_ratio,
        "memory_ok": abs(mem_ratio - 1) <= MEMORY_TOLERANCE,
        "bytes_ok": abs(bytes_ratio - 1) <= BYTES_TOLERANCE,
    }


def _refused(row: dict, message: str, devices, seconds: float) -> dict:
    """XLA would not compile the layout for lack of memory: the planner said it fits."""
    need = re.search(r"temporaries \(([\d.]+)G\)", message)
    xla_temp = float(need.group(1)) * 2**30 if need else math.nan
    predicted = row["memory_bytes"]
    xla_peak = xla_temp + predicted["params"] + predicted["optimizer"] + predicted["batch"]
    return {
        "platform": devices[0].platform,
        "compile_s": seconds,
        "refused": message.splitlines()[0][:300],
        "xla_peak_bytes": xla_peak,
        "xla_temp_bytes": xla_temp,
        "predicted_peak_bytes": predicted["peak"],
        "memory_ratio": predicted["peak"] / xla_peak,
        "hlo_collective_bytes": math.nan,
        "predicted_collective_bytes": row["comm_bytes"],
        "bytes_ratio": math.nan,
        "memory_ok": False,
        "bytes_ok": False,
    }
