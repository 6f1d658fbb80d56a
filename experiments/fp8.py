"""FP8 on the CPU (emulated): --fp8 delayed and current against the compute dtype (issue #42).

    python experiments/fp8.py                        # tiny, bf16, 3 recipes x 3 seeds x 200 steps
    python experiments/fp8.py --from-json            # the saved runs summarized again
    python experiments/fp8.py --steps 50 --out DIR   # a quick look, in DIR

The tiny preset in bfloat16 on one fake CPU device, every projection in FP8 (`--fp8-filter
none`: tiny's are below the shape filter). Per seed, the three recipes start from the same
initial weights and read the same batches (the embedded corpus, TokenBatches seeded by the
seed) for the same steps and schedule (OptimConfig's defaults). XLA's CPU backend converts the
f8 operands to f32 before each GEMM, so the runs carry FP8's rounding exactly (an emulation:
nothing here says how fast FP8 is). Held-out loss: jaxdist.evaluation.evaluate, in the compute
dtype, on the last batches of each seed's first epoch, which no run reaches. Reported per
recipe: the final held-out loss and its gap to off's, in %, per seed (paired) and over seeds;
the median step time (shared cores: noisy). Writes results/fp8_cpu.json.
"""

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import time
from typing import get_args

from jaxdist.layout import Fp8Recipe

RECIPES = get_args(Fp8Recipe)  # off first: the baseline the FP8 recipes are compared with
ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_recipe(recipe: str, args):
    """(build for a seed, the model config): one compile per recipe, whatever the seed."""
    from jaxdist.config import OptimConfig
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.mesh import make_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    mc = get_model_config(args.model, compute_dtype=args.dtype)
    mesh = make_mesh("data=1")
    tx, lr = make_optimizer(OptimConfig(), args.steps)
    step = StepConfig(fp8=recipe, fp8_filter="none")
    layout = Layout.on(mesh, STANDARD_RULES, step, batch_size=args.batch_size, seq_len=mc.seq_len)

    def make(seed: int):
        return build(model_spec(mc).init, tx, lr, layout, mesh, seed=seed)

    return make, mc


def train(recipe: str, seed: int, built, args) -> dict:
    """One run: held-out loss before and after, training loss, skipped steps, step times."""
    import jax
    import numpy as np

    from jaxdist.config import DataConfig
    from jaxdist.data import TokenBatches
    from jaxdist.evaluation import evaluate

    make, mc = built
    data = TokenBatches(
        DataConfig(batch_size=args.batch_size, seed=seed), mc.seq_len, mc.vocab_size
    )
    held_out = [data.num_windows // args.batch_size - 1 - i for i in range(args.eval_batches)]
    if held_out[-1] < args.steps:  # the runs would train on what they are judged by
        raise SystemExit(f"{args.steps} steps read into the held-out tail of the epoch")
    jitted = make(seed)
    state, times, losses, skipped = jitted.init_fn(), [], [], 0
    start = evaluate(jitted, jitted.weights(state), data, held_out)
    t0 = time.perf_counter()
    for s in range(args.steps):
        batch = jax.block_until_ready(jax.device_put(data.batch(s), jitted.batch_sharding))
        t1 = time.perf_counter()
        state, metrics = jitted.step_fn(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        skipped += not bool(metrics["finite"])
        times.append(time.perf_counter() - t1)
    return {
        "recipe": recipe,
        "seed": seed,
        "initial_eval_loss": start,
        "final_eval_loss": evaluate(jitted, jitted.weights(state), data, held_out),
        "final_train_loss": float(np.mean(losses[-10:])),
        "skipped_steps": skipped,
        "step_s": float(np.median(times)),
        "run_s": time.perf_counter() - t0,
    }


def summarize(runs: list[dict]) -> dict:
    """Per recipe: the final held-out loss over seeds and its gap to off's, paired by seed."""
    from jaxdist.metrics.records import distribution

    by = {r: {run["seed"]: run for run in runs if run["recipe"] == r} for r in RECIPES}
    gaps = {
        r: {
            str(s): 100 * (by[r][s]["final_eval_loss"] / by["off"][s]["final_eval_loss"] - 1)
            for s in sorted(set(by[r]) & set(by["off"]))
        }
        for r in RECIPES[1:]
    }
    return {
        "eval_loss": {r: distribution([x["final_eval_loss"] for x in by[r].values()]) for r in by},
        "step_s": {r: distribution([x["step_s"] for x in by[r].values()]) for r in by},
        "gap_pct_per_seed": gaps,
        "gap_pct": {r: distribution(list(g.values())) for r, g in gaps.items()},
        "within_1pct": all(abs(v) <= 1 for g in gaps.values() for v in g.values()),
    }


def print_table(record: dict) -> None:
    s, a = record["summary"], record["args"]
    print(
        f"\n{a['model']} ({a['dtype']}, every projection in FP8), {a['steps']} steps x "
        f"{a['batch_size']} rows, held-out loss over {a['eval_batches']} batches; "
        f"commit {record['meta']['commit']}"
    )
    print(f"{'recipe':>8s} {'seed':>4s} {'eval loss':>10s} {'gap %':>7s} {'step ms':>8s}")
    for run in record["runs"]:
        gap = s["gap_pct_per_seed"].get(run["recipe"], {}).get(str(run["seed"]))
        shown = "" if gap is None else f"{gap:+7.2f}"
        print(
            f"{run['recipe']:>8s} {run['seed']:>4d} {run['final_eval_loss']:10.4f} {shown:>7s} "
            f"{run['step_s'] * 1e3:8.1f}"
        )
    for r, d in s["gap_pct"].items():
        print(f"{r}: gap to off p50 {d['p50']:+.2f}%, max {d['max']:+.2f}% over {d['n']} seeds")
    print(f"every gap within 1%: {s['within_1pct']}")


def meta() -> dict:
    """When, where and at which commit the runs were made."""
    import jax

    def git(*cmd: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *cmd], capture_output=True, text=True
        ).stdout.strip()

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "tree_clean": git("status", "--porcelain", "--untracked-files=no") == "",
        "cpus": len(os.sched_getaffinity(0)),
        "versions": {"jax": jax.__version__},
    }


def run_all(args, path: pathlib.Path) -> dict:
    from jaxdist.mesh import setup_devices

    setup_devices("cpu:1")
    built, runs = {}, []
    record = {"args": vars(args), "meta": meta(), "runs": runs}
    t_start = time.perf_counter()
    for seed in (int(s) for s in args.seeds.split(",")):  # seeds outermost: pairs survive a cut
        for recipe in RECIPES:
            built[recipe] = built.get(recipe) or build_recipe(recipe, args)
            runs.append(r := train(recipe, seed, built[recipe], args))
            print(
                f"{recipe:8s} seed {seed}  eval {r['final_eval_loss']:.4f}  "
                f"step {r['step_s'] * 1e3:.0f} ms  run {r['run_s']:.0f} s",
                flush=True,
            )
            record["wall_s"] = time.perf_counter() - t_start
            path.write_text(json.dumps(record, indent=1))
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="bfloat16", help="the compute dtype off runs in")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--from-json", action="store_true", help="summarize the saved runs again")
    ap.add_argument("--out", default=None, help="results directory (default: experiments/results)")
    args = ap.parse_args()
    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fp8_cpu.json"
    record = json.loads(path.read_text()) if args.from_json else run_all(args, path)
    record["summary"] = summarize(record["runs"])
    path.write_text(json.dumps(record, indent=1))
    print_table(record)


if __name__ == "__main__":
    main()
