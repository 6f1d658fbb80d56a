"""Muon against AdamW at equal tokens, each at its defaults: held-out loss over seeds (issue #43).

    python experiments/optimizers.py                    # 2 optimizers x 3 seeds x 200 steps
    python experiments/optimizers.py --from-json        # the saved runs summarized again
    python experiments/optimizers.py --seeds 0 --steps 50 --out DIR   # a quick look, in DIR

The tiny preset on two fake CPU devices (`data=2`: Muon's matrices lie whole on each device, so
its Newton-Schulz runs where the weights are; the sharded path is tests/test_muon.py's). Per
seed, both optimizers start from the same initial weights (the seed) and read the same batches
(the embedded corpus, TokenBatches seeded by the seed) for the same steps; OptimConfig's
defaults but --optimizer (the schedule, warmup, clipping and weight decay shared; Muon's own
muon_lr, muon_beta, muon_ns_steps at theirs). Held-out loss: jaxdist.evaluation.evaluate on the
last batches of each seed's first epoch, which the run never reaches. Reported: final held-out
loss p50/p90/max per optimizer over seeds, and per seed the paired difference Muon - AdamW
(same seed, same data), with its p50/p90/max; the median step time (CPU, shared cores: noisy).
Writes results/optimizers.json.
"""

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import time

OPTIMIZERS = ("adamw", "muon")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def compile_optimizer(name: str, args):
    """(build for a seed, the seed-0 JittedStep, model config): one compile per optimizer."""
    from jaxdist.config import OptimConfig
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.mesh import make_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    mc = get_model_config(args.model)
    mesh = make_mesh(args.mesh)
    tx, lr = make_optimizer(OptimConfig(optimizer=name), args.steps)
    layout = Layout.on(
        mesh, STANDARD_RULES, StepConfig(), batch_size=args.batch_size, seq_len=mc.seq_len
    )

    def make(seed: int):
        return build(model_spec(mc).init, tx, lr, layout, mesh, seed=seed)

    return make, make(0), mc


def train(name: str, seed: int, built, args) -> dict:
    """One run: held-out loss before and after, training loss, step times."""
    import jax
    import numpy as np

    from jaxdist.config import DataConfig
    from jaxdist.data import TokenBatches
    from jaxdist.evaluation import evaluate

    make, jitted, mc = built
    data = TokenBatches(
        DataConfig(batch_size=args.batch_size, seed=seed), mc.seq_len, mc.vocab_size
    )
    epoch_steps = data.num_windows // args.batch_size
    held_out = [epoch_steps - 1 - i for i in range(args.eval_batches)]
    if held_out[-1] < args.steps:  # the runs would train on what they are judged by
        raise SystemExit(f"{args.steps} steps read into the held-out tail of the epoch")
    state = make(seed).init_fn()  # the seed's weights; the step program is seed 0's
    start = evaluate(jitted, jitted.weights(state), data, held_out)
    times, losses = [], []
    t0 = time.perf_counter()
    for s in range(args.steps):
        batch = jax.device_put(data.batch(s), jitted.batch_sharding)
        jax.block_until_ready(batch)
        t1 = time.perf_counter()
        state, metrics = jitted.step_fn(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        times.append(time.perf_counter() - t1)
    return {
        "optimizer": name,
        "seed": seed,
        "initial_eval_loss": start,
        "final_eval_loss": evaluate(jitted, jitted.weights(state), data, held_out),
        "final_train_loss": float(np.mean(losses[-8:])),
        "step_s": float(np.median(times)),
        "run_s": time.perf_counter() - t0,
    }


def summarize(runs: list[dict]) -> dict:
    """Per optimizer: the final held-out loss over seeds; per seed, Muon - AdamW."""
    from jaxdist.metrics.records import distribution

    by = {o: {r["seed"]: r for r in runs if r["optimizer"] == o} for o in OPTIMIZERS}
    paired = sorted(set(by["adamw"]) & set(by["muon"]))
    diff = {s: by["muon"][s]["final_eval_loss"] - by["adamw"][s]["final_eval_loss"] for s in paired}
    return {
        "eval_loss": {o: distribution([r["final_eval_loss"] for r in by[o].values()]) for o in by},
        "step_s": {o: distribution([r["step_s"] for r in by[o].values()]) for o in by},
        "muon_minus_adamw_per_seed": diff,
        "muon_minus_adamw": distribution(list(diff.values())),
        "muon_at_or_below_on_every_seed": bool(diff) and all(d <= 0 for d in diff.values()),
    }


def print_table(record: dict) -> None:
    s, runs = record["summary"], record["runs"]
    a = record["args"]
    print(
        f"\n{a['model']} on {a['mesh']}, {a['steps']} steps x {a['batch_size']} rows, "
        f"held-out loss over {a['eval_batches']} batches; commit {record['meta']['commit']}"
    )
    print(f"{'seed':>4s} {'AdamW':>8s} {'Muon':>8s} {'Muon-AdamW':>11s}")
    for seed, d in s["muon_minus_adamw_per_seed"].items():
        loss = {r["optimizer"]: r["final_eval_loss"] for r in runs if r["seed"] == int(seed)}
        print(f"{seed:>4} {loss['adamw']:8.4f} {loss['muon']:8.4f} {d:+11.4f}")
    print(f"{'':4s} {'p50':>8s} {'p90':>8s} {'max':>8s} {'step ms p50':>12s}")
    for o in OPTIMIZERS:
        e = s["eval_loss"][o]
        ms = s["step_s"][o]["p50"] * 1e3
        print(f"{o:>5s} {e['p50']:7.4f} {e['p90']:8.4f} {e['max']:8.4f} {ms:12.1f}")
    d = s["muon_minus_adamw"]
    print(
        f"Muon - AdamW: p50 {d['p50']:+.4f}, p90 {d['p90']:+.4f}, max {d['max']:+.4f}; "
        f"at or below on every seed: {s['muon_at_or_below_on_every_seed']}"
    )


def meta() -> dict:
    """When, where and at which commit the runs were made."""
    import jax
    import optax

    def git(*cmd: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *cmd], capture_output=True, text=True
        ).stdout.strip()

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "tree_clean": git("status", "--porcelain", "--untracked-files=no") == "",
        "cpus": len(os.sched_getaffinity(0)),
        "versions": {"jax": jax.__version__, "optax": optax.__version__},
    }


def run_all(args, path: pathlib.Path) -> dict:
    from jaxdist.mesh import setup_devices

    setup_devices(args.devices)
    seeds = [int(s) for s in args.seeds.split(",")]
    t_start = time.perf_counter()
    built, runs = {}, []
    record = {"args": vars(args), "meta": meta(), "runs": runs}
    for seed in seeds:  # seeds outermost: a run cut short still has pairs
        for name in OPTIMIZERS:
            if name not in built:
                built[name] = compile_optimizer(name, args)
            runs.append(r := train(name, seed, built[name], args))
            print(
                f"{name:5s} seed {seed}  eval {r['final_eval_loss']:.4f}  "
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
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--mesh", default="data=2")
    ap.add_argument("--devices", default="cpu:2", help="cpu:N fake CPU devices")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--from-json", action="store_true", help="summarize the saved runs again")
    ap.add_argument("--out", default=None, help="results directory (default: experiments/results)")
    args = ap.parse_args()
    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "optimizers.json"
    record = json.loads(path.read_text()) if args.from_json else run_all(args, path)
    record["summary"] = summarize(record["runs"])
    path.write_text(json.dumps(record, indent=1))
    print_table(record)


if __name__ == "__main__":
    main()
