"""Issue 29's one device call: every H200 figure in one run, into one results file.

Parts, in the order they run (the first ones are the issue's targets; a part whose estimated
time no longer fits the budget is skipped and named in the file):
  1. the device's own GPU target config (XLA dumps it beside a compile), against the
     committed jaxdist/planning/gpu_targets/h200.txtpb;
  2. `jaxdist bench` beside the torch.compile peer: gpt2-124m batch 32, 1b batch 8 (remat dots,
     the presets' own, which the deviceless compile puts under the peer's memory);
  3. `jaxdist bench --model moe-1b` (MFU on active parameters);
  4. five profiled steps of gpt2-124m (`train --profile` turns command buffers off), trimmed
     to a test fixture with its raw-kernel truth (tests/make_gpu_trace.py), and the parser's
     busy time per step beside the truth's;
  5. the async save of the 1b training state beside plain Orbax (checkpoint_blocking.py);
  6. if time is left: remat auto (none), the plain-JAX peer, the Llama presets;
  7. the deviceless compile's memory estimate (`train --compile-only --target h200:1`, run on
     four CPU cores in the background from the start) beside each measured peak.

Prepare on the CPU host (the two folders are git-ignored and travel with the call's `carry`):

    echo /.peers/ >> .git/info/exclude; echo /.whl/ >> .git/info/exclude
    mkdir -p .peers && cp ../shared/peers/*.py .peers/
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 -d .whl grain==0.2.18 tyro==1.0.17 tensorboardX==2.6.5 \\
      docstring-parser==0.18.0 typeguard==4.6.1 array-record==0.8.6 portpicker==1.6.0
    python experiments/h200.py --smoke --torch-python PYTHON_WITH_TORCH   # all parts, tiny, CPU

The call (device tool: carry [".peers", ".whl"], timeout_s 600; about 8 minutes):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit; \\
      PYTHONUNBUFFERED=1 python3 experiments/h200.py --out $OUT 2>&1 | tee $OUT/h200.log

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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments import gpu_vs_peers as vs  # noqa: E402
from experiments import h200_checks as checks  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Plan:
    core: tuple  # (model, batch): jaxdist and torch.compile, the targets
    moe: tuple
    checkpoint: str
    profile: tuple  # (model, batch)
    extra_models: tuple  # (model, batch): jaxdist only, if time is left
    remat: str = "dots"
    steps: int = 30
    bench_flags: tuple = ()
    devices: str = "auto"


FULL = Plan(
    core=(("gpt2-124m", 32), ("1b", 8)),
    moe=("moe-1b", 8),
    checkpoint="1b",
    profile=("gpt2-124m", 32),
    extra_models=(("llama-124m", 32), ("llama-1b", 8)),
)
# Every code path on one fake CPU device in a few minutes: the tiny presets, the peers on CPU.
SMOKE = Plan(
    core=(("tiny", 8),),
    moe=("tiny-moe", 8),
    checkpoint="tiny",
    profile=("tiny", 8),
    extra_models=(("tiny-llama", 8),),
    steps=3,
    bench_flags=("--devices", "cpu:1", "--mesh", "data=1"),
    devices="cpu:1",
)
# Seconds each part is expected to take on the H200 (compile included), for the budget.
ESTIMATE_S = {"bench": 60, "torch": 90, "jax": 45, "checkpoint": 110, "profile": 75}


class Run:
    """The results file, rewritten after every part so that a call cut short keeps what ran."""

    def __init__(self, out: pathlib.Path, budget_s: float, smoke: bool):
        self.out, self.t0, self.budget_s = out, time.monotonic(), budget_s
        self.data = {"meta": checks.meta(smoke), "parts": {}, "skipped": []}
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
            result = fn(*args, max(self.left(), 1.0))
        except Exception as e:  # noqa: BLE001 - one part failing must not lose the others
            result = {"error": f"{type(e).__name__}: {e}"}
        self.data["parts"][name] = {"wall_s": round(time.monotonic() - t, 1), "result": result}
        print(f"[{time.monotonic() - self.t0:6.0f} s] {name}: {json.dumps(result)[:300]}")
        self.save()
        return result

    def save(self) -> None:
        (self.out / "h200.json").write_text(json.dumps(self.data, indent=1) + "\n")


def deviceless_thread(configs: list, results: dict, smoke: bool) -> threading.Thread:
    """XLA's GPU compiler on four CPU cores, beside the device work: the estimate a user gets
    from `train --compile-only --target h200:1` for each measured step."""

    def pin():  # keep the benchmarks' host threads on the other cores
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[-4:] if len(cpus) > 8 else cpus)

    def work():
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        for model, batch, remat in configs:
            cmd = [
                sys.executable,
                *("-m", "jaxdist.cli", "train", "--model", model, "--batch-size", str(batch)),
                *("--remat", remat, "--compile-only", "--target", "h200:1"),
                *(("--compile-cache", "off") if smoke else ()),
            ]
            try:
                r = subprocess.run(
                    cmd, capture_output=True, text=True, env=env, timeout=600, preexec_fn=pin
                )
                lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
                rep = json.loads(lines[-1]) if lines else {"error": r.stderr[-2000:]}
            except subprocess.TimeoutExpired:
                rep = {"error": "timed out"}
            keep = ("peak_gib", "per_device_bytes", "remat", "kernels", "compile_s", "error")
            results[(model, batch, remat)] = {k: rep[k] for k in keep if k in rep}

    t = threading.Thread(target=work, daemon=True)
    t.start()
    return t


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="h200-out", help="the results folder ($OUT in the call)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole call")
    ap.add_argument("--peers", default=".peers")
    ap.add_argument("--torch-python", default="python3", help="a Python with torch ('' skips)")
    ap.add_argument("--smoke", action="store_true", help="every part, tiny, on CPU")
    args = ap.parse_args()
    plan = SMOKE if args.smoke else FULL
    out = pathlib.Path(args.out)
    run = Run(out, args.budget, args.smoke)
    # the measured steps' policy first; auto (the planner's choice, none when it fits) after
    measured = [(m, b, plan.remat) for m, b in (*plan.core, plan.moe)]
    measured += [(m, b, "auto") for m, b in plan.core]
    estimates: dict = {}
    worker = deviceless_thread(measured, estimates, args.smoke)
    run.part("target config", "config", checks.target_config, out)

    rows = compare(run, plan, args.torch_python, "", args.peers, plan.core, plan.remat)
    cmd = vs.ours_cmd(*plan.moe, plan.steps, plan.remat, plan.bench_flags)
    run.part(f"bench {plan.moe[0]}", "bench", vs.run_json, cmd)
    run.part("profile", "profile", checks.profile, out, *plan.profile, plan.remat, plan.bench_flags)
    run.part("checkpoint", "checkpoint", checks.checkpoint, plan.checkpoint, plan.devices)
    # What is left of the budget: the default policy (auto: none when it fits), plain JAX.
    rows += compare(run, plan, "", sys.executable, args.peers, plan.core, "auto")
    rows += compare(run, plan, "", "", args.peers, plan.extra_models, plan.remat)

    worker.join(timeout=max(run.left(), 5))
    run.data["deviceless"] = {" ".join(map(str, k)): v for k, v in estimates.items()}
    run.data["rows"] = rows
    run.data["targets"] = checks.targets(run.data, rows, plan)
    run.save()
    vs.print_table(rows)
    for t in run.data["targets"]:
        print(json.dumps(t))
    print(f"{out / 'h200.json'}; {time.monotonic() - run.t0:.0f} s in all")


if __name__ == "__main__":
    main()
