"""Aux-loss-free bias balancing against the auxiliary balance loss (issue #55): expert load and
held-out loss over seeds.

    python experiments/moe.py                              # 2 methods x 3 seeds x 300 steps
    python experiments/moe.py --seeds 0 --steps 50         # a quick look

The tiny-moe preset with DeepSeek-V3's router (sigmoid scores, top 2 of 8 experts, weights
renormalized) on one CPU device, dispatched without drops (capacity E/K). Two methods, each at
DeepSeek's setting: `aux`, the Switch balance loss at coefficient 0.01 and no bias; `bias`, the
selection bias moved by 0.001 x sign(mean load - load) each step (jaxdist.optim) with a tiny
balance loss (1e-4) beside it. Per seed both start from the same weights and read the same
batches. Reported per seed and method: max/mean expert load (the largest over layers and
experts of load / its layer's mean) averaged over the last 10 steps, and the held-out loss
(jaxdist.evaluation.evaluate on the last batches of the first epoch, which no run reaches).
Writes results/moe.json.
"""

import argparse
import json
import pathlib
import time

METHODS = {
    "aux": dict(balance_coef=0.01),
    "bias": dict(balance_coef=1e-4, router_bias=True, bias_update_rate=0.001),
}
ROUTER = dict(scoring="sigmoid", capacity_factor=4.0)


def run(method: str, seed: int, args) -> dict:
    import jax
    import numpy as np

    from jaxdist.config import DataConfig, OptimConfig
    from jaxdist.data import TokenBatches
    from jaxdist.evaluation import evaluate
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.mesh import make_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    mc = get_model_config(args.model, **ROUTER, **METHODS[method])
    mesh = make_mesh("single")
    tx, lr = make_optimizer(OptimConfig(), args.steps)
    layout = Layout.on(
        mesh, STANDARD_RULES, StepConfig(), batch_size=args.batch_size, seq_len=mc.seq_len
    )
    jitted = build(model_spec(mc).init, tx, lr, layout, mesh, seed=seed)
    data = TokenBatches(
        DataConfig(batch_size=args.batch_size, seed=seed), mc.seq_len, mc.vocab_size
    )
    epoch_steps = data.num_windows // args.batch_size
    held_out = [epoch_steps - 1 - i for i in range(args.eval_batches)]
    if held_out[-1] < args.steps:
        raise SystemExit(f"{args.steps} steps read into the held-out tail of the epoch")
    state, load_max = jitted.init_fn(), []
    t0 = time.perf_counter()
    for s in range(args.steps):
        state, metrics = jitted.step_fn(state, jax.device_put(data.batch(s), jitted.batch_sharding))
        load_max.append(float(metrics["moe_load_max"]))
    return {
        "method": method,
        "seed": seed,
        "load_max_over_mean": float(np.mean(load_max[-10:])),
        "eval_loss": evaluate(jitted, jitted.weights(state), data, held_out),
        "run_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--out", default=None, help="results directory (default: experiments/results)")
    args = ap.parse_args()
    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    print(f"{'seed':>4s} {'method':>6s} {'max/mean load':>14s} {'eval loss':>10s}")
    for seed in (int(s) for s in args.seeds.split(",")):
        for method in METHODS:
            runs.append(r := run(method, seed, args))
            print(f"{seed:>4d} {method:>6s} {r['load_max_over_mean']:14.3f} {r['eval_loss']:10.4f}")
            (out / "moe.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        load = sum(r["load_max_over_mean"] for r in mine) / len(mine)
        loss = sum(r["eval_loss"] for r in mine) / len(mine)
        print(f"mean {method:>6s} {load:14.3f} {loss:10.4f}")


if __name__ == "__main__":
    main()
