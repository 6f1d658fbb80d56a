"""The parts of experiments/h200.py that are not a benchmark beside a peer: the results file's
header, the device's target config, checkpoint blocking, the profiled fixture, FP8's prediction
and ratios, and the targets.

None of this initializes a JAX backend in the driver's own process: on a GPU, JAX would take
most of the card's memory, and every measurement runs in a process of its own.
"""

import datetime
import difflib
import gzip
import importlib.metadata
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMITTED_TARGET = ROOT / "jaxdist" / "compiled" / "gpu_targets" / "h200.txtpb"
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint", "torch")


def meta(smoke: bool, commit: str | None) -> dict:
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            versions[p] = None
    card = _sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"])
    here = _sh(["git", "-C", str(ROOT), "rev-parse", "HEAD"]).strip()
    disk = shutil.disk_usage(ROOT)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "card": card.splitlines()[-1] if card else "no GPU (nvidia-smi absent)",
        "versions": versions,
        "python": sys.version.split()[0],
        "commit": commit or here or None,
        "cpus": len(os.sched_getaffinity(0)),
        # where the checkpoints are written: tmpfs would make a "disk" save a RAM copy
        "checkpoint_disk": {
            "filesystem": _sh(["df", "--output=fstype", str(ROOT)]).split()[-1:],
            "free_gib": round(disk.free / 2**30, 1),
        },
        "smoke": smoke,
    }


def preflight(data: dict, devices: str) -> bool:
    """Every import the parts need, in one short process, before any device time is spent on
    compiles: a missing wheel ends the call at once, naming the module."""
    code = (
        "import grain, tyro, tensorboardX, jaxdist.cli.main, jaxdist.profiling.bench, "
        "jaxdist.checkpoint.store, models.presets, meshes.presets; print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    data["preflight"] = "ok" if r.returncode == 0 else r.stderr.strip()[-1500:]
    return r.returncode == 0


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode:
        raise RuntimeError(f"exit {r.returncode}: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return r


def target_config(out: pathlib.Path, timeout: float) -> dict:
    """XLA writes the GpuTargetConfigProto it compiled for beside a dumped module: on the
    device, the card's own, which deviceless compiles need (compiled/gpu_targets/)."""
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={d}"}
        code = "import jax, jax.numpy as n; jax.jit(n.sin).lower(n.ones(8)).compile()"
        _run([sys.executable, "-c", code], min(timeout, 120), env)
        found = sorted(pathlib.Path(d).glob("*gpu_target_config.pbtxt"))
        if not found:
            return {"error": "no gpu_target_config.pbtxt dumped: the backend is not a GPU"}
        shutil.copy(found[0], out / "h200_target.pbtxt")
        theirs = found[0].read_text().splitlines()
    ours = [x for x in COMMITTED_TARGET.read_text().splitlines() if not x.startswith("#")]
    diff = [x for x in difflib.unified_diff(ours, theirs, lineterm="", n=0) if x[:1] in "+-"]
    return {"file": "h200_target.pbtxt", "differs_from_committed": diff[2:]}


def grouped_gemm(timeout: float) -> dict:
    """experiments/grouped_gemm_gpu.py: the experts' Pallas grouped GEMMs against XLA's ragged
    dot on this GPU (values, gradients, time); the CPU host cannot run the kernels."""
    from gpu_vs_peers import run_json

    return run_json([sys.executable, str(ROOT / "experiments" / "grouped_gemm_gpu.py")], timeout)


def checkpoint(model: str, devices: str, timeout: float) -> dict:
    """experiments/checkpoint_blocking.py on the model's whole training state, written under
    the repository (the machine's disk, not /tmp); a run cut short keeps its synchronous
    saves (the script prints them first)."""
    from gpu_vs_peers import run_json

    with tempfile.TemporaryDirectory(dir=ROOT, prefix=".ckpt-") as d:
        cmd = [
            sys.executable,
            str(ROOT / "experiments" / "checkpoint_blocking.py"),
            *("--model", model, "--devices", devices, "--mesh", "fsdp=-1"),
            # three async saves of each kind, two synchronous (16 s each for 1b on an H200)
            *("--repeats", "2", "--sync-repeats", "1", "--dir", d),
        ]
        return run_json(cmd, timeout)


def profile(out, model: str, batch: int, remat: str, flags: tuple, timeout: float) -> dict:
    """Five traced steps (after three untraced; `train --profile` turns command buffers off,
    so that each kernel is its own trace event); then the fixture and its truth, and the
    parser's busy time per step beside the truth's. The raw trace comes back gzipped too."""
    from jaxdist.profiling.xplane import find_xplane

    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            *("-m", "jaxdist.cli", "train", "--model", model, "--batch-size", str(batch)),
            *("--remat", remat, "--steps", "8", "--profile", "3:8", "--run-dir", d, *flags),
            # no save at step 0 (the auto interval measures one) writing behind traced steps
            *("--checkpoint-every", "100000"),
        ]
        _run(cmd, timeout)
        here = pathlib.Path(d) / "profile"
        report = json.loads((here / "breakdown.json").read_text())
        shutil.copy(here / "breakdown.json", out / "gpu_trace.breakdown.json")
        raw = find_xplane(here)
        if raw.stat().st_size < 60 * 2**20:  # gzip makes it a few times smaller; 16 MiB back
            with raw.open("rb") as f, gzip.open(out / "gpu_trace.raw.xplane.pb.gz", "wb") as g:
                shutil.copyfileobj(f, g)
        trim = [sys.executable, str(ROOT / "tests" / "make_gpu_trace.py"), str(raw)]
        trim += [str(out), "--name", "gpu_trace"]
        r = subprocess.run(trim, capture_output=True, text=True, timeout=120)
    if r.returncode:  # a CPU trace (the smoke run) has no GPU plane to trim
        return {"fixture": None, "why": r.stderr.strip()[-500:], "summary": report["summary"]}
    truth = json.loads((out / "gpu_trace.truth.json").read_text())
    parsed = {(x["step"], str(x["device"])): x["step_s"] - x["idle_s"] for x in report["steps"]}
    busy = [
        {
            "step": t["step"],
            "device": dev,
            "truth_s": t["busy_s"],
            "parser_s": parsed.get((t["step"], dev)),
        }
        for dev, per_step in truth["devices"].items()
        for t in per_step
    ]
    size = (out / "gpu_trace.xplane.pb").stat().st_size
    return {"fixture_bytes": size, "busy": busy, "summary": report["summary"]}


def fp8_plan(plan, recipe: str, timeout: float) -> dict:
    """The planner's FP8 figures for the FP8 part's step on one H200 (`jaxdist plan --fp8`,
    on the CPU backend: the GPU stays free), and its predicted tokens/s."""
    model, batch = plan.fp8
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "plan.json"
        cmd = [
            sys.executable,
            *("-m", "jaxdist.cli", "plan", "--model", model, "--hardware", "h200"),
            *("--devices", "1", "--mesh", "data=1", "--batch-size", str(batch)),
            *("--remat", plan.remat, "--fp8", recipe, *plan.fp8_flags, "--json", str(path)),
        ]
        _run(cmd, timeout, {**os.environ, "JAX_PLATFORMS": "cpu"})
        row = json.loads(path.read_text())["layouts"][0]
    return row["fp8"] | {"tokens_per_s": row["tokens_per_s"]}


def fp8_ratios(off: dict | None, fp8: dict | None, predicted: dict | None) -> dict:
    """An FP8 run over the same step with --fp8 off: tokens/s (the loop's and the synced, as
    the peers are compared) and peak memory; the planner's predicted speedup beside them."""
    from gpu_vs_peers import mem_gib

    out = {}
    if off and fp8 and "tokens_per_s" in off and "tokens_per_s" in fp8:
        out["tokens_per_s"] = fp8["tokens_per_s"] / off["tokens_per_s"]
        if off.get("tokens_per_s_synced") and fp8.get("tokens_per_s_synced"):
            out["tokens_per_s_synced"] = fp8["tokens_per_s_synced"] / off["tokens_per_s_synced"]
        if mem_gib(off) and mem_gib(fp8):
            out["peak_memory"] = mem_gib(fp8) / mem_gib(off)
    if predicted and "speedup" in predicted:
        out["predicted_speedup"] = predicted["speedup"]
        if "tokens_per_s_synced" in out:
            out["measured_over_predicted"] = out["tokens_per_s_synced"] / predicted["speedup"]
    return out


def _fp8_targets(data: dict) -> list[dict]:
    """FP8 pays (synced tokens/s over off's above 1), holds no more than 5% more memory, and
    gains what the planner predicted (within 10%)."""
    f = data.get("fp8") or {}
    out = []
    for recipe, r in (f.get("ratios") or {}).items():
        name = f"{f['model']} --fp8 {recipe}"
        out.append(_target(f"{name} tokens/s over off", r.get("tokens_per_s_synced"), 1.0, True))
        out.append(_target(f"{name} peak memory over off", r.get("peak_memory"), 1.05, False))
        out.append(
            _target(f"{name} measured / predicted speedup", r.get("measured_over_predicted"))
        )
    return out


def targets(data: dict, rows: list[dict], plan) -> list[dict]:
    """Each of the issue's targets with what this call measured for it (None: not measured)."""
    from gpu_vs_peers import TARGETS, mem_gib

    out = []
    for row in rows:
        need = TARGETS.get(row["model"])
        if need is None or row["remat"] != plan.remat:
            continue
        # the peers wait for every step; so does this jaxdist figure (the loop's own, which
        # reads the loss a step late, is in the row as speed_vs_torch)
        speed, memory = row.get("synced_speed_vs_torch"), row.get("memory_vs_torch")
        out.append(_target(f"{row['model']} tokens/s over torch.compile", speed, need, True))
        out.append(_target(f"{row['model']} peak memory over torch.compile", memory, 1.0, False))
    moe = next((r for r in rows if r["model"] == plan.moe[0]), {}).get("jaxdist") or {}
    out.append(_target(f"{plan.moe[0]} MFU on active parameters", moe.get("mfu"), 0.40, True))
    ck = (data["parts"].get("checkpoint") or {}).get("result") or {}
    out.append(_target("async save blocked / sync save", ck.get("blocked_over_sync"), 0.02, False))
    ratio = None
    if ck.get("async_blocked_s") and ck.get("orbax_alone_blocked_s"):
        ratio = statistics.median(ck["async_blocked_s"]) / statistics.median(
            ck["orbax_alone_blocked_s"]
        )
    out.append(_target("async save blocked / plain Orbax's (medians)", ratio, 1.0, False))
    estimates = data.get("deviceless") or {}
    for row in rows:
        ours = row.get("jaxdist") or {}
        est = estimates.get(f"{row['model']} {row['batch']} {row['remat']}", {})
        peak = est.get("per_device_bytes", {}).get("peak_estimate")
        if peak and mem_gib(ours):  # a part skipped or failed measured no peak
            t = _target(f"deviceless / measured peak, {row['model']}", peak / 2**30 / mem_gib(ours))
            # the same program on both sides: the policy each compile ended with
            t["remat"] = {"device": ours.get("remat"), "deviceless": est.get("remat")}
            out.append(t)
    return out + _fp8_targets(data)


def _target(name: str, value, need=None, higher_is_better=None) -> dict:
    """need None: a ratio to 1, met within 10% (the deviceless estimate against the peak)."""
    met = None
    if value is not None and need is not None:
        met = value >= need if higher_is_better else value <= need
    elif value is not None:
        met = abs(value - 1) <= 0.10
    return {"target": name, "measured": value, "need": need, "met": met}
