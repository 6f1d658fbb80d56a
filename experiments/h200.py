"""Issue 29's one device call: every H200 figure in one run, into one results file.

Parts, in the order they run (the first ones are the issue's targets; a part whose estimated
time no longer fits the budget is skipped and named in the file):
  1. the device's own GPU target config (XLA dumps it beside a compile), against the
     committed jaxdist/compiled/gpu_targets/h200.txtpb;
  1b. the experts' Pallas grouped GEMMs against XLA's ragged dot (experiments/grouped_gemm_gpu.py:
     values, gradients, time; issue 55), which no CPU host can run;
  2. `jaxdist bench` beside the torch.compile peer: gpt2-124m batch 32, 1b batch 8 (remat dots,
     the presets' own, which the deviceless compile puts under the peer's memory);
  3. `jaxdist bench --model moe-1b` (MFU on active parameters);
  4. the async save of the 1b training state beside plain Orbax, save by save in turn
     (checkpoint_blocking.py);
  5. five profiled steps of gpt2-124m (`train --profile` turns command buffers off), trimmed
     to a test fixture with its raw-kernel truth (tests/make_gpu_trace.py), and the parser's
     busy time per step beside the truth's; the raw trace comes back too, gzipped;
  6. FP8 (issue 42): `jaxdist bench` of 1b with `--fp8 delayed` and `--fp8 current` beside
     `--fp8 off` (part 2's run), tokens/s and peak memory over off's, beside the planner's
     predicted speedup (`plan --fp8`, on the CPU); the deviceless compiles of both recipes
     give their GEMM census (every projection's GEMMs on f8 operands) and peak estimates;
  7. if time is left: remat auto (none), the plain-JAX peer, the Llama presets;
  8. the deviceless compile's memory estimate (`train --compile-only --target h200:1`, run on
     four CPU cores in the background from the start) beside each measured peak.

Prepare on the CPU host (the two folders are git-ignored and travel with the call's `carry`):

    echo /.peers/ >> .git/info/exclude; echo /.whl/ >> .git/info/exclude
    mkdir -p .peers && cp ../shared/peers/*.py .peers/
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 -d .whl grain==0.2.18 tyro==1.0.17 tensorboardX==2.6.5 \\
      docstring-parser==0.18.0 typeguard==4.6.1 array-record==0.8.6 portpicker==1.6.0
    python experiments/h200.py --smoke --torch-python PYTHON_WITH_TORCH   # all parts, tiny, CPU

The call (device tool: carry [".peers", ".whl"], timeout_s 600; about 8 minutes; the FP8
part's two benches and plans, about 160 s by ESTIMATE_S, come before part 7, which the budget
skips first):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target .site .whl/*.whl && export PYTHONPATH=.site:. || exit; \\
      PYTHONUNBUFFERED=1 python3 experiments/h200.py --out $OUT --commit HASH \\
      2>&1 | tee $OUT/h200.log

(HASH: `git rev-parse HEAD` here, of a clean tree: the copy that travels has no history.)

Back here: $OUT/h200.json goes to experiments/results/, gpu_trace.* to tests/fixtures/gpu_trace/,
h200_target.pbtxt is compared with (or replaces) the committed target config.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import gpu_vs_peers as vs  # this folder's, beside this script
import h200_checks as checks


@dataclasses.dataclass(frozen=True)
class Plan:
    core: tuple  # (model, batch): jaxdist and torch.compile, the targets
    moe: tuple
    checkpoint: str
    profile: tuple  # (model, batch)
    extra_models: tuple  # (model, batch): jaxdist only, if time is left
    fp8: tuple  # (model, batch): --fp8 delayed and current beside off
    remat: str = "dots"
    steps: int = 30
    bench_flags: tuple = ()
    # With --fp8: the smoke run's tiny projections are below worth_fp8's bar, so it forces them.
    fp8_flags: tuple = ()
    devices: str = "auto"

    @property
    def measured(self) -> tuple:
        """The steps measured with the plan's policy, whose deviceless estimate is compared."""
        return (*self.core, self.moe)


FULL = Plan(
    core=(("gpt2-124m", 32), ("1b", 8)),
    moe=("moe-1b", 8),
    checkpoint="1b",
    profile=("gpt2-124m", 32),
    extra_models=(("llama-124m", 32), ("llama-1b", 8)),
    fp8=("1b", 8),
)
# Every code path on one fake CPU device in a few minutes: the tiny presets, the peers on CPU.
SMOKE = Plan(
    core=(("tiny", 8),),
    moe=("tiny-moe", 8),
    checkpoint="tiny",
    profile=("tiny", 8),
    extra_models=(("tiny-llama", 8),),
    fp8=("tiny", 8),
    steps=3,
    bench_flags=("--devices", "cpu:1", "--mesh", "data=1"),
    fp8_flags=("--fp8-filter", "none"),
    devices="cpu:1",
)
# Seconds each part is expected to take on the H200 (compile included), for the budget: a
# part starts only if its estimate fits what is left, and is stopped at twice its estimate
# plus a minute, so that one hang cannot take the whole call.
# Measured in the 2026-12-04 call (h200.json, each part's wall_s), rounded up: benches 35 to
# 60 s (FP8's compile is the longest), torch 49 to 63, jax 22, checkpoint 73, profile 30, plan 7.
ESTIMATE_S = {
    **{"bench": 60, "torch": 65, "jax": 30, "checkpoint": 80, "profile": 40, "plan": 10},
    "grouped": 60,
}
FP8_RECIPES = ("delayed", "current")


class Run:
    """The results file, rewritten after every part so that a call cut short keeps what ran."""

    def __init__(self, out: pathlib.Path, budget_s: float, smoke: bool, commit: str | None):
        self.out, self.t0, self.budget_s = out, time.monotonic(), budget_s
        self.data = {"meta": checks.meta(smoke, commit), "parts": {}, "skipped": []}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def part(self, name: str, kind: str, fn, *args):
        """Runs fn(*args, timeout) if its estimate fits what is left; records the result."""
        need = ESTIMATE_S.get(kind, 30)
        if self.left() < need:
            self.data["skipped"].append(f"{name}: {need} s estimated, {self.left():.0f} s left")
            self.save()
            return None
        t = time.monotonic()
        try:
            result = fn(*args, max(min(self.left(), 2 * need + 60), 1.0))
        except Exception as e:  # noqa: BLE001 - one part failing must not lose the others
            result = {"error": f"{type(e).__name__}: {e}"}
        self.data["parts"][name] = {"wall_s": round(time.monotonic() - t, 1), "result": result}
        print(f"[{time.monotonic() - self.t0:6.0f} s] {name}: {json.dumps(result)[:300]}")
        self.save()
        return result

    def save(self) -> None:
        (self.out / "h200.json").write_text(json.dumps(self.data, indent=1) + "\n")


def deviceless_thread(configs: list, results: dict, smoke: bool):
    """XLA's GPU compiler on four CPU cores, beside the device work: the estimate a user gets
    from `train --compile-only --target h200:1` for each measured step, compiled by the same
    code in the same call. (It competes with the parts' compiles for the host, not with their
    timed steps, which wait on the GPU.)"""
    procs: list[subprocess.Popen] = []

    def work():
        # Pins this thread, so the compilers it starts inherit four cores of their own.
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[-4:] if len(cpus) > 8 else cpus)
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        for model, batch, remat, *flags in configs:  # flags: --fp8's, where given
            cmd = [
                sys.executable,
                *("-m", "jaxdist.cli", "train", "--model", model, "--batch-size", str(batch)),
                *("--remat", remat, "--compile-only", "--target", "h200:1", "--json", "-"),
                *(("--compile-cache", "off") if smoke else ()),
                *flags,
            ]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            procs.append(proc)
            stdout, stderr = proc.communicate()
            lines = [x for x in stdout.decode().splitlines() if x.startswith("{")]
            rep = json.loads(lines[-1]) if lines else {"error": stderr.decode()[-2000:]}
            keep = ("peak_gib", "per_device_bytes", "remat", "kernels", "gemms", "compile_s")
            results[(model, batch, remat, *flags)] = {
                k: rep[k] for k in (*keep, "error") if k in rep
            }

    t = threading.Thread(target=work, daemon=True)
    t.start()
    return t, procs  # the compilers, ended by main() if still running when the budget is spent


def compare(run: Run, plan: Plan, py_torch: str, py_jax: str, peers: str, models, remat: str):
    """jaxdist then each peer, per model, one process each."""
    rows = []
    for model, batch in models:
        row = {"model": model, "batch": batch, "remat": remat}
        cmd = vs.ours_cmd(model, batch, plan.steps, remat, plan.bench_flags)
        row["jaxdist"] = run.part(f"bench {model} {remat}", "bench", vs.run_json, cmd)
        for kind, key, py in (("torch", "torch", py_torch), ("jax", "jax_peer", py_jax)):
            if py and model in vs.PEER_ARGS:
                cpu = plan.devices.startswith("cpu")
                cmd = vs.peer_cmd(py, peers, kind, model, batch, plan.steps, cpu)
                row[key] = run.part(f"{kind} peer {model}", kind, vs.run_json, cmd)
        rows.append(row | vs.ratios(row))
    return rows


def fp8(run: Run, plan: Plan, rows: list[dict]) -> dict:
    """The FP8 part's model (1b) with --fp8 delayed and current, each in its own `jaxdist
    bench` process as every bench here; off is part 2's run of the same model, batch and
    remat (run again where it is missing). Tokens/s (the loop's and the synced) and peak
    memory over off's, and the planner's predicted speedup beside them."""
    model, batch = plan.fp8
    same = (model, batch, plan.remat)
    off = next((r["jaxdist"] for r in rows if (r["model"], r["batch"], r["remat"]) == same), None)
    if not off or "error" in off:
        cmd = vs.ours_cmd(model, batch, plan.steps, plan.remat, plan.bench_flags)
        off = run.part(f"bench {model} {plan.remat}", "bench", vs.run_json, cmd)
    out = {"model": model, "batch": batch, "remat": plan.remat, "off": off, "ratios": {}}
    for recipe in FP8_RECIPES:
        flags = (*plan.bench_flags, "--fp8", recipe, *plan.fp8_flags)
        cmd = vs.ours_cmd(model, batch, plan.steps, plan.remat, flags)
        out[recipe] = run.part(
            f"bench {model} {plan.remat} --fp8 {recipe}", "bench", vs.run_json, cmd
        )
        predicted = run.part(f"plan {model} --fp8 {recipe}", "plan", checks.fp8_plan, plan, recipe)
        out["ratios"][recipe] = checks.fp8_ratios(off, out[recipe], predicted)
        print(f"--fp8 {recipe} over off, {model} batch {batch}: {out['ratios'][recipe]}")
    run.data["fp8"] = out
    run.save()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="h200-out", help="the results folder ($OUT in the call)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole call")
    ap.add_argument("--peers", default=".peers")
    ap.add_argument("--torch-python", default="python3", help="a Python with torch ('' skips)")
    ap.add_argument("--commit", default=None, help="the commit measured (the copy has no .git)")
    ap.add_argument("--smoke", action="store_true", help="every part, tiny, on CPU")
    args = ap.parse_args()
    plan = SMOKE if args.smoke else FULL
    out = pathlib.Path(args.out)
    run = Run(out, args.budget, args.smoke, args.commit)
    if not checks.preflight(run.data, plan.devices):
        run.save()
        raise SystemExit(f"preflight failed: {run.data['preflight']}")
    estimates: dict = {}
    # The FP8 compiles last: the measured steps' estimates come first.
    fp8_compiles = [(*plan.fp8, plan.remat, "--fp8", r, *plan.fp8_flags) for r in FP8_RECIPES]
    worker, compilers = deviceless_thread(
        [(m, b, plan.remat) for m, b in plan.measured] + fp8_compiles, estimates, args.smoke
    )
    run.part("target config", "config", checks.target_config, out)
    run.part("grouped GEMM", "grouped", checks.grouped_gemm)

    rows = compare(run, plan, args.torch_python, "", args.peers, plan.core, plan.remat)
    rows += compare(run, plan, "", "", args.peers, [plan.moe], plan.remat)
    run.part("checkpoint", "checkpoint", checks.checkpoint, plan.checkpoint, plan.devices)
    run.part("profile", "profile", checks.profile, out, *plan.profile, plan.remat, plan.bench_flags)
    fp8(run, plan, rows)
    # What is left of the budget: the default policy (auto: none when it fits), plain JAX.
    rows += compare(run, plan, "", sys.executable, args.peers, plan.core, "auto")
    rows += compare(run, plan, "", "", args.peers, plan.extra_models, plan.remat)

    worker.join(timeout=max(run.left(), 5))
    for proc in compilers:
        if proc.poll() is None:
            proc.kill()
            run.data["skipped"].append(f"deviceless compile {proc.args[5]}: out of time")
    run.data["deviceless"] = {" ".join(map(str, k)): v for k, v in estimates.items()}
    run.data["rows"] = rows
    run.save()
    run.data["targets"] = checks.targets(run.data, rows, plan)
    run.save()
    vs.print_table(rows)
    for t in run.data["targets"]:
        print(json.dumps(t))
    print(f"{out / 'h200.json'}; {time.monotonic() - run.t0:.0f} s in all")


if __name__ == "__main__":
    main()
