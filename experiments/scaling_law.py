"""Held-out loss against training compute for small transformers, and its power law.

    python experiments/scaling_law.py                  # 20 runs, about 6 min on 2 cores
    python experiments/scaling_law.py --sizes "2,32,2;2,64,4;4,128,4" --levels 8  # longer

An IsoFLOP grid (Chinchilla's approach 2): GPT-2 style models from the `tiny` preset
(dataclasses.replace of depth, width, heads, MLP and seq_len 64), 12K to 390K parameters, each
trained at compute levels C = C0 * 2^k (1.25e10 to 8e11 FLOPs by default) wherever that gives
between --min-steps and --max-steps steps of 16 x 64 bytes, so 20 runs. Compute is
C = flops_per_token * tokens (PaLM's 6N + 12LdT, N without embedding lookups). Data: the
embedded corpus (the Python standard library read as bytes, vocab 256); loss is measured on
held-out windows, the tail of the first epoch of the same shuffled stream, which no run reaches
(the longest run reads 80% of an epoch: nothing is repeated). Each run is jaxdist's own
setup on one device (jaxdist.train.prepare): jaxdist.optim's AdamW, clipping and decay mask,
and its warmup-cosine schedule fitted to the run, warmed up over 10% of it and decaying to 10%
at its last step (Chinchilla: a schedule longer than the run misstates the loss); the held-out
loss is jaxdist.evaluation.evaluate. make_optimizer bakes the run length into the schedule, so every
(size, budget) run builds and compiles its own step: these tiny models compile in seconds, but
seconds per run add up (compile and first step: about 4 s a run on 2 idle cores, some 80 s of
the default grid; recorded per run as compile_and_first_step_s). Every budget of a size starts
from the same weights (same seed). results/scaling_law.json was made with an in-script
schedule of the same shape; this setup gives the same training losses (to 4 digits, as compared).

The compute-efficient frontier: each level's best run, where no cheaper level's beats it. On
it we fit the pure power law L = a C^-gamma (Kaplan et al. 2020: 0.050) and
L = a C^-gamma + L_inf (Chinchilla's L(N, D) = E + A/N^0.34 + B/D^0.28 implies
L - E ~ C^-0.154 on its compute-optimal path;
refits put it at 0.15-0.18), printed side by side with the numbers ("context") that say how far
this regime is from the published ones. Models of 1M+ parameters (--sizes) cannot get near
their compute-optimal token count on 2 CPU cores in minutes, so they never reach the frontier.
Here every level's best run is the smallest size it holds (no IsoFLOP minimum is bracketed)
and the frontier's pure exponent comes out near 0.10, the floor unidentifiable; at 16 x 64 bytes
a step the larger models are step-limited (--batch-size 4 lowers their loss at equal compute).
Writes experiments/results/scaling_law.json and .png.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import time

import plots

# (layers, d_model, heads): d_mlp = 4 d, GPT-2 style as the tiny preset.
SIZES = ((1, 16, 2), (2, 32, 2), (2, 64, 4), (3, 96, 4))
KAPLAN_GAMMA = 0.050
CHINCHILLA_GAMMA = 0.34 * 0.28 / (0.34 + 0.28)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=";".join(",".join(map(str, s)) for s in SIZES))
    ap.add_argument("--compute", type=float, default=1.25e10, help="lowest level C0, FLOPs")
    ap.add_argument("--levels", type=int, default=7, help="levels C0 * 2^k, k < levels")
    ap.add_argument("--min-steps", type=int, default=50)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="data order and initial weights")
    ap.add_argument("--out", default=None, help="results directory (default: experiments/results)")
    args = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split(",")) for s in args.sizes.split(";")]
    levels = [args.compute * 2**k for k in range(args.levels)]

    import jax
    import numpy as np

    from jaxdist.config import DataConfig, LoopConfig, OptimConfig, RunConfig
    from jaxdist.data import TokenBatches, load_corpus
    from jaxdist.evaluation import evaluate
    from jaxdist.mesh import make_mesh
    from jaxdist.train import prepare
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    # One device: the law is about model and data size, not parallelism.
    mesh = make_mesh("single")
    device = mesh.devices.flat[0]
    B, T = args.batch_size, args.seq_len
    data = DataConfig(batch_size=B, seed=args.seed)
    tokens_per_step = B * T

    # The grid first: every (size, budget) with min..max steps, checked against the held-out
    # tail before anything trains.
    grid = []
    for L, d, h in sizes:
        mc = get_model_config(
            "tiny", num_layers=L, d_model=d, num_heads=h, num_kv_heads=h, d_mlp=4 * d, seq_len=T
        )
        mc = dataclasses.replace(mc, name=f"L{L}-d{d}")
        per_step = mc.flops_per_token() * tokens_per_step
        budgets = [
            (C, round(C / per_step))
            for C in levels
            if args.min_steps <= round(C / per_step) <= args.max_steps
        ]
        if not budgets:
            print(f"{mc.name}: no compute level gives {args.min_steps}..{args.max_steps} steps")
            continue
        grid.append(((L, d, h), mc, budgets))
    if not grid:
        raise SystemExit("no run in the grid: widen --levels or --min-steps..--max-steps")
    epoch_steps = TokenBatches(data, T, grid[0][1].vocab_size).num_windows // B
    held_out = [epoch_steps - 1 - i for i in range(args.eval_batches)]
    longest = max(n for *_, budgets in grid for _, n in budgets)
    if longest >= held_out[-1]:
        raise ValueError(
            f"a {longest}-step run would read into the held-out tail of the {epoch_steps}-step "
            "epoch; lower --max-steps or --eval-batches"
        )
    t_start = time.perf_counter()

    runs = []
    for (L, d, h), mc, budgets in grid:
        spec = model_spec(mc)
        for C, steps in budgets:
            t0 = time.perf_counter()
            # jaxdist's optimizer, its schedule fitted to this run: warmup over 10% of the run,
            # cosine decay to min_lr_ratio at its last step. The run length is baked into the
            # compiled step, so every run builds its own. The same seed gives every budget of a
            # size the same initial weights.
            optim = OptimConfig(learning_rate=args.lr, warmup_steps=max(1, steps // 10))
            config = RunConfig(optim=optim, data=data, loop=LoopConfig(steps=steps, seed=args.seed))
            c, batches = prepare(spec, mesh, STANDARD_RULES, config)
            state = c.init_fn()
            losses = []
            for s in range(steps):
                state, metrics = c.step_fn(
                    state, jax.device_put(batches.batch(s), c.batch_sharding)
                )
                if s == 0:  # the step compiled and ran once
                    jax.block_until_ready(metrics)
                    first_s = time.perf_counter() - t0
                losses.append(metrics["loss"])  # fetched after the run: no per-step stall
            held = evaluate(c, state.params, batches, held_out)
            train = np.array(jax.device_get(losses))
            tokens = steps * tokens_per_step
            run = {
                "model": mc.name,
                "layers": L,
                "d_model": d,
                "heads": h,
                "params": c.num_params,
                "non_embedding_params": 12 * L * d * d,
                "flops_per_token": mc.flops_per_token(),
                "level": C,
                "steps": steps,
                "tokens": tokens,
                "compute": mc.flops_per_token() * tokens,
                "compute_6ND": 6 * c.num_params * tokens,
                "held_out_loss": held,
                "train_loss_last10pct": float(train[-max(1, steps // 10) :].mean()),
                "train_loss_curve": train.tolist(),
                "wall_s": time.perf_counter() - t0,
                "compile_and_first_step_s": first_s,
            }
            runs.append(run)
            print(
                f"{mc.name:8s} {c.num_params / 1e3:6.1f}K params {steps:5d} steps "
                f"{tokens / 1e6:6.2f}M tokens  C {run['compute']:.2e}  held-out {held:.4f}  "
                f"train {run['train_loss_last10pct']:.4f}  {run['wall_s']:5.1f} s "
                f"({first_s:.1f} s compile + first step)",
                flush=True,
            )
            del state

    fits = fit(runs)
    corpus = np.frombuffer(load_corpus(None), dtype=np.uint8)
    p_byte = np.bincount(corpus, minlength=256) / len(corpus)
    unigram = float(-(p_byte[p_byte > 0] * np.log(p_byte[p_byte > 0])).sum())
    ctx = context(runs, fits, unigram, len(corpus), T)
    print_fits(fits, ctx)

    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "device": {"platform": device.platform, "kind": device.device_kind},
        "host_cpus": os.cpu_count(),
        "jax": jax.__version__,
        "args": vars(args),
        "runs": runs,
        "fits": fits,
        "context": ctx,
        "compile_and_first_step_s": sum(r["compile_and_first_step_s"] for r in runs),
        "wall_s": time.perf_counter() - t_start,
    }
    (out / "scaling_law.json").write_text(json.dumps(record, indent=1))
    plots.scaling_law(runs, fits, unigram, out / "scaling_law.png")
    print(
        f"wall {record['wall_s']:.0f} s, of which compiles and first steps "
        f"{record['compile_and_first_step_s']:.0f} s"
    )


def frontier(runs: list[dict]) -> list[dict]:
    """Each compute level's best run, kept where no cheaper level's best beats it.

    By level, not by each run's own C: runs of one level differ in C only by step rounding."""
    best, out = float("inf"), []
    for level in sorted({r["level"] for r in runs}):
        r = min((r for r in runs if r["level"] == level), key=lambda r: r["held_out_loss"])
        if r["held_out_loss"] < best:
            best = r["held_out_loss"]
            out.append(r)
    return out


def fit_power(C, loss) -> dict:
    """L = a C^-gamma (log-log least squares) and L = a C^-gamma + L_inf (curve_fit)."""
    import numpy as np
    from scipy.optimize import curve_fit

    C, loss = np.asarray(C, float), np.asarray(loss, float)
    slope, intercept = np.polyfit(np.log(C), np.log(loss), 1)
    pure = {"a": float(np.exp(intercept)), "gamma": float(-slope)}
    c_ref = C.min()  # C / c_ref keeps the fit well conditioned

    def law(x, a, g, l_inf):
        return a * (x / c_ref) ** -g + l_inf

    out = {"pure": pure, "points": len(C)}
    if len(C) < 4:
        out["with_floor"] = None  # three parameters need more than three points to mean much
        return out
    try:
        (a, g, l_inf), cov = curve_fit(
            law,
            C,
            loss,
            p0=(loss[0] - 0.5 * loss.min(), max(pure["gamma"], 0.05), 0.5 * loss.min()),
            bounds=([0, 0, 0], [np.inf, 5, loss.min()]),
            maxfev=20000,
        )
        err = np.sqrt(np.diag(cov)) if np.all(np.isfinite(cov)) else [np.nan] * 3
        out["with_floor"] = {
            "a": float(a * c_ref**g),  # back in L = a C^-gamma + L_inf
            "gamma": float(g),
            "gamma_stderr": float(err[1]),
            "l_inf": float(l_inf),
            "l_inf_stderr": float(err[2]),
            "l_inf_at_bound": bool(l_inf < 1e-6 or l_inf > loss.min() - 1e-6),
        }
    except (RuntimeError, ValueError) as e:
        out["with_floor"] = {"failed": str(e)}
    return out


def fit(runs: list[dict]) -> dict:
    import numpy as np

    front = frontier(runs)
    C = [r["compute"] for r in front]
    loss = [r["held_out_loss"] for r in front]
    if len(front) < 3:
        return {"frontier": [{"model": r["model"], "tokens": r["tokens"]} for r in front]}
    result = {
        "frontier": [{"model": r["model"], "tokens": r["tokens"]} for r in front],
        "frontier_fit": fit_power(C, loss),
        # The same fit on C = 6ND (all parameters, embeddings too), the simpler convention.
        "frontier_fit_6ND": fit_power([r["compute_6ND"] for r in front], loss),
    }
    # How much gamma depends on single points: the pure fit with each frontier point left out.
    if len(front) > 3:
        loo = [
            fit_power(C[:i] + C[i + 1 :], loss[:i] + loss[i + 1 :])["pure"]["gamma"]
            for i in range(len(C))
        ]
        result["pure_gamma_leave_one_out"] = [float(min(loo)), float(max(loo))]
    # Per model size, loss against tokens: the data exponent of L(D) at fixed N.
    by_model = {}
    for name in dict.fromkeys(r["model"] for r in runs):
        rs = [r for r in runs if r["model"] == name]
        if len(rs) > 1:
            slope = np.polyfit(
                np.log([r["tokens"] for r in rs]), np.log([r["held_out_loss"] for r in rs]), 1
            )[0]
            by_model[name] = float(-slope)
    result["pure_gamma_per_model_vs_tokens"] = by_model
    return result


def context(runs, fits, unigram, corpus_bytes, seq_len) -> dict:
    """Numbers that say how far this regime is from the one the published laws describe."""
    import numpy as np

    best = min(r["held_out_loss"] for r in runs)
    models = {r["model"]: r for r in runs}.values()
    emb_share = [1 - r["non_embedding_params"] / r["params"] for r in models]
    attn_share = [12 * r["layers"] * r["d_model"] * seq_len / r["flops_per_token"] for r in models]
    front = [r["compute"] for r in frontier(runs)]
    # An IsoFLOP minimum means something only when a smaller and a larger size bracket it.
    isoflop = {}
    for level in sorted({r["level"] for r in runs}):
        rs = sorted((r for r in runs if r["level"] == level), key=lambda r: r["params"])
        i = min(range(len(rs)), key=lambda i: rs[i]["held_out_loss"])
        isoflop[f"{level:.3g}"] = {
            "best": rs[i]["model"],
            "bracketed": 0 < i < len(rs) - 1,
            "tokens_per_param": rs[i]["tokens"] / rs[i]["params"],
        }
    return {
        "ln256_nats": float(np.log(256)),
        "unigram_entropy_nats": unigram,
        "best_loss_nats": best,
        "best_bits_per_byte": best / np.log(2),
        "compute_decades_on_frontier": float(np.log10(max(front) / min(front))),
        "max_tokens_over_corpus": max(r["tokens"] for r in runs) / corpus_bytes,
        "max_tokens_per_param": max(r["tokens"] / r["params"] for r in runs),
        "min_tokens_per_param": min(r["tokens"] / r["params"] for r in runs),
        "embedding_and_head_share_of_params": [float(min(emb_share)), float(max(emb_share))],
        "attention_share_of_flops": [float(min(attn_share)), float(max(attn_share))],
        "isoflop_minimum": isoflop,
    }


def print_fits(fits: dict, ctx: dict) -> None:
    if "frontier_fit" not in fits:
        print(f"only {len(fits['frontier'])} runs on the frontier: too few to fit")
        return
    f = fits["frontier_fit"]
    print(
        f"\nfrontier ({f['points']} runs): "
        + ", ".join(f"{r['model']}@{r['tokens'] // 1024}K" for r in fits["frontier"])
    )
    print(f"{'':34s} {'gamma':>7s} {'L_inf':>7s}")
    print(f"{'pure power law a C^-g':34s} {f['pure']['gamma']:7.3f} {'-':>7s}")
    wf = f["with_floor"]
    if wf and "gamma" in wf:
        flag = " (L_inf at its bound)" if wf["l_inf_at_bound"] else ""
        print(
            f"{'a C^-g + L_inf':34s} {wf['gamma']:7.3f} {wf['l_inf']:7.3f}"
            f"  +- {wf['gamma_stderr']:.3f}, {wf['l_inf_stderr']:.3f}{flag}"
        )
    g6 = fits["frontier_fit_6ND"]["pure"]["gamma"]
    print(f"{'pure, C = 6ND (all params)':34s} {g6:7.3f}")
    if "pure_gamma_leave_one_out" in fits:
        lo, hi = fits["pure_gamma_leave_one_out"]
        print(f"{'pure, leave one point out':34s} {lo:.3f}..{hi:.3f}")
    print(f"{'Kaplan 2020 (pure, L(C_min))':34s} {KAPLAN_GAMMA:7.3f}")
    print(
        f"{'Chinchilla (above E, 0.34*0.28/0.62)':34s} {CHINCHILLA_GAMMA:7.3f}  (refits 0.15-0.18)"
    )
    print(
        "per model, loss vs tokens (pure): "
        + ", ".join(f"{k} {v:.3f}" for k, v in fits["pure_gamma_per_model_vs_tokens"].items())
    )
    flat = {k: v for k, v in ctx.items() if k != "isoflop_minimum"}
    print(
        "context: "
        + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in flat.items()})
    )
    for level, m in ctx["isoflop_minimum"].items():
        edge = "" if m["bracketed"] else "  (not bracketed: an end of the sizes run at this level)"
        print(f"  C {level}: best {m['best']}, {m['tokens_per_param']:.0f} tokens/param{edge}")


if __name__ == "__main__":
    main()
