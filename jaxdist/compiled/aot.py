"""Ahead-of-time: compile the real train step for abstract inputs, on the devices present or on
a target this host does not have (jaxdist.compiled.tpu, jaxdist.compiled.gpu), and read XLA's
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
compiled/gpu_targets/ against (experiments/h200.py saves it).
"""

import math
import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxdist.compiled import gemms, hlo, overlap
from jaxdist.compiled.memory import xla_peak
from jaxdist.config import OptimConfig
from jaxdist.errors import ConfigError
from jaxdist.hardware import get_hardware
from jaxdist.layout import Layout
from jaxdist.mesh import MeshConfig, build_mesh
from jaxdist.model import ModelSpec
from jaxdist.optim import make_optimizer
from jaxdist.parallel import schedules
from jaxdist.parallel.pipeline import branch_share
from jaxdist.planning import fit
from jaxdist.step import JittedStep, build

MEMORY_TOLERANCE = 0.15  # predicted vs XLA's per-device memory
BYTES_TOLERANCE = 0.05  # predicted vs the compiled HLO's collective bytes


def compile_only(jitted: JittedStep) -> dict:
    """XLA's per-device memory analysis, collectives and cost analysis of the step, compiled
    for its layout's batch."""
    t0 = time.perf_counter()
    exe = jitted.compile_abstract()
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
    layout = jitted.layout
    share = branch_share(schedules.for_layout(layout)) if layout.stages > 1 else None
    collectives = hlo.summarize(hlo.collectives(text, dict(mesh.shape), share))
    platform = mesh.devices.flat[0].platform
    accelerator = {}
    if platform in ("gpu", "tpu"):
        # The GEMMs by the types they read (FP8 projections that fell back to 16 bits show),
        # the attention kernel and host transfers.
        accelerator = gemms.analyze(text, layout.seq_len)
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
        # Per device, loop trips multiplied in: the experts' grouped GEMMs apart (ragged_dots).
        "matmuls": gemms.matmul_flops(text),
        "collectives": [
            {"axis": axis, "kind": kind, **v} for (axis, kind), v in sorted(collectives.items())
        ],
        # The asynchronous collectives and the matmul FLOPs scheduled under them, per step.
        "scheduled_under": overlap.summary(overlap.scheduled(text, dict(mesh.shape))),
        **accelerator,
    }


def compile_fitting(
    policy: str, order: Sequence[str], compile_at: Callable[[str], dict]
) -> tuple[dict, list[str]]:
    """The report of the step compiled at `policy` (`compile_at(policy)`, with `fits` where
    the device's memory is known) and the policies tried. Where the compiler refuses the step
    for lack of memory, or its peak does not fit, the next leaner policy of `order`
    (jaxdist.planning.fit.next_policy) is compiled in turn, until one fits or none is left;
    an empty `order` tries `policy` alone. A ConfigError where every policy tried was refused."""
    tried = []
    while True:
        tried.append(policy)
        try:
            report, refusal = compile_at(policy), None
        except Exception as e:  # XLA's TPU compiler refuses a step that cannot fit the chip
            if not fit.refused_for_memory(e):
                raise
            report, refusal = None, str(e).splitlines()[0][:200]
        leaner = fit.next_policy(order, policy)
        if leaner is None or (report is not None and report.get("fits", True)):
            break
        policy = leaner
    if report is None:
        leaner = "" if order else ", a leaner --remat (or auto)"
        raise ConfigError(
            f"XLA refused the step for lack of memory at every policy tried ({', '.join(tried)}): "
            f"{refusal}; use a smaller --batch-size{leaner} or a mesh that shards more "
            "(a context axis splits long rows)"
        )
    return report, tried


def memory_fit(report: dict, memory_bytes: float | None, predicted_peak: float) -> dict:
    platform = report["platform"]
    """The compiled peak beside the one price's prediction and, where the device's memory is
    known, whether the program fits it (jaxdist.planning.fit: the same rule as the plan's)."""
    peak = report["per_device_bytes"]["peak_estimate"]
    out = {
        "predicted_peak_bytes": predicted_peak,
        "memory_ratio": predicted_peak / peak if peak else math.nan,
        "peak_gib": round(peak / 2**30, 2),
    }
    if memory_bytes is not None:
        out |= {
            "device_memory_bytes": memory_bytes,
            "device_gib": round(memory_bytes / 2**30, 2),
            "usable_gib": round(fit.usable(memory_bytes, platform, predicted=False) / 2**30, 2),
            "fits": fit.fits(peak, memory_bytes, platform, predicted=False),
        }
    return out


def target_report(hardware: str, report: dict, model: ModelSpec, layout: Layout) -> dict:
    """The model's FLOPs per device and, where the program was compiled for an accelerator,
    the attention kernel it runs and what would make it slow or fail there."""
    hw = get_hardware(hardware)
    tokens = layout.batch_size * layout.seq_len
    out = {
        # No XLA FLOP count beside it: XLA's cost analysis counts a loop's body once, so the
        # layer scan's FLOPs came out at 1/L of the step's (a ratio of 0.035-0.054 on 7B).
        "model_flops_per_device": model.flops_per_token * tokens / layout.devices,
    }
    if "kernels" in report:
        attention = getattr(model.config, "attention", None)
        out["attention_kernel"] = attention_kernel(report["kernels"], report["platform"], attention)
        usable = fit.usable(hw.memory_bytes, hw.platform, predicted=False)
        out["warnings"] = warnings(report | out, usable)
    return out


def attention_kernel(kernels: dict, platform: str, attention: str | None) -> str:
    """The attention the program runs, in words."""
    a = kernels["attention"]
    if platform == "gpu":
        if a["cudnn_fused_forward"] and a["cudnn_fused_backward"]:
            return "cudnn fused (forward and backward)"
        if a["cudnn_fused_forward"]:
            return "cudnn fused forward, XLA backward"
        return "xla (fallback: T x T scores in memory)"
    if platform == "tpu":
        if attention == "splash" and a["tpu_custom_calls"]:
            return "splash (Pallas kernel)"
        return "xla (T x T scores in memory)"
    return "xla"


def warnings(report: dict, memory_bytes: float) -> list[str]:
    """What would make the step slow or fail on the target, one line each."""
    out = []
    if not report["attention_kernel"].startswith(("cudnn fused (", "splash")):
        out.append(f"attention is not fused: {report['attention_kernel']}")
    wide = sum(report["gemms"]["not_16bit"].values())
    if wide:
        out.append(
            f"{wide} matmuls with 32-bit operands (slower than bf16 on tensor cores): see "
            "gemms.not_16bit"
        )
    if report["kernels"]["host_transfers"]:
        out.append(f"{report['kernels']['host_transfers']} host transfers inside the step")
    peak = report["per_device_bytes"]["peak_estimate"]
    if peak > memory_bytes:
        out.append(
            f"peak {peak / 2**30:.1f} GiB per device is over the "
            f"{memory_bytes / 2**30:.1f} GiB a program may hold on the device"
        )
    return out


def verify(row: dict, model: ModelSpec, layout: Layout, devices: list) -> dict:
    """Compiles a planned layout's real train step for abstract inputs on `devices` and sets
    XLA's memory and the HLO's collective bytes beside the planner's predictions (`row`)."""
    mesh = build_mesh(MeshConfig(ici=layout.sizes), devices)
    tx, lr = make_optimizer(OptimConfig(), 100)
    t0 = time.perf_counter()
    jitted = build(model.init, tx, lr, layout, mesh)
    try:
        exe = jitted.compile_abstract()
    except Exception as e:  # the TPU compiler refuses a step that cannot fit the chip
        if not fit.refused_for_memory(e):
            raise
        return _refused(row, str(e), devices, time.perf_counter() - t0)
    mem = exe.memory_analysis()
    peak, memory = xla_peak(mem), get_hardware(row["hardware"]).memory_bytes
    share = branch_share(schedules.for_layout(layout)) if layout.stages > 1 else None
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
        "fits": fit.fits(peak, memory, devices[0].platform, predicted=False),
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
        "fits": False,
    }
