"""The simulated link of experiments/overhead_shift.py: a step's wall time from the measured
compute and the compiled programs' bytes over the slow axis, at 1 to 400 Gbit/s (alpha-beta,
jaxdist.planning.costmodel's ring), and where each config beats data parallelism to the same
loss; its table and plot. The study's docstring says what is measured and what simulated."""

import json
import pathlib

GBPS = (1, 10, 100, 400)


def alphas(args) -> dict:
    """Per collective kind, alpha per ring step (s): --alpha-s, else alpha_beta.py's fits."""
    fitted = json.loads((pathlib.Path(__file__).parent / "results/alpha_beta.json").read_text())
    fits = {k: v["alpha_step_s"] for k, v in fitted["fits"].items()}
    default = fits["all-reduce"]
    return {
        k: args.alpha_s if args.alpha_s is not None else fits.get(k, default)
        for k in ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
    }


def comm_s(priced, gbps: float, alpha: dict) -> float:
    from jaxdist.hardware import Link
    from jaxdist.planning.costmodel import collective_time

    bw = gbps * 1e9 / 8
    return sum(
        n * collective_time(kind, b, 2, Link(alpha.get(kind, alpha["all-reduce"]), bw))
        for kind, b, n in priced
    )


def mean_step(tr: dict, extra: dict, compute: float, gbps: float, alpha, delay: int) -> float:
    """Simulated seconds of a step, averaged over the run: compute, the outer steps' own extra
    compute, exposed communication (a delayed exchange hides behind `delay` steps' compute)."""
    total = 0.0
    for key, t in tr.items():
        comm = comm_s(t["priced"], gbps, alpha)
        exposed = max(0.0, comm - delay * compute) if delay and key != "None" else comm
        total += (compute + extra.get(key, 0.0) + exposed) * t["runs"]
    return total / sum(t["runs"] for t in tr.values())


def steps_to(loss: float, steps_at: list[int], curve) -> float | None:
    """Steps at which a p50 eval curve first reaches `loss` (linear between eval points)."""
    for i in range(1, len(curve)):
        if curve[i] <= loss:
            a, b = curve[i - 1], curve[i]
            f = 1.0 if a == b else (a - loss) / (a - b)
            return steps_at[i - 1] + min(1.0, max(0.0, f)) * (steps_at[i] - steps_at[i - 1])
    return None


def crossover(speed, ratio: float, dp_speed) -> float | None:
    """Gbit/s below which a config (steps x speed(b)) beats DP (ratio x steps x dp_speed(b)),
    by bisection on log bandwidth over 1 Mbit/s .. 10 Tbit/s; inf: at all, 0: at none of them."""
    import math

    def ahead(g):
        return speed(g) < ratio * dp_speed(g)

    lo, hi = 1e-3, 1e4
    if ahead(hi):
        return math.inf
    if not ahead(lo):
        return 0.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ahead(mid) else (lo, mid)
    return lo


def config_row(layout: tuple, rs, dp, tr: dict, compute: float, alpha, scale: float):
    """One config's row: `layout` is its (mesh, SyncConfig kwargs or None)."""
    import numpy as np

    from jaxdist.metrics.records import distribution

    mesh, kwargs = layout
    kwargs = kwargs or {}
    extra = {  # the outer step's own CPU time beyond its run's inner step
        k: scale
        * max(0.0, float(np.median([r["outer_step_s"][k] - r["inner_step_s"] for r in rs])))
        for k in tr
        if k != "None"
    }
    finals = [r["final_eval_loss"] for r in rs]
    dp_by_seed = {d["seed"]: d["final_eval_loss"] for d in dp}
    gap = {
        r["seed"]: r["final_eval_loss"] / dp_by_seed[r["seed"]] - 1
        for r in rs
        if r["seed"] in dp_by_seed
    }
    total = sum(t["runs"] for t in tr.values())
    delay = kwargs.get("sync_delay", 0)
    return {
        "mesh": mesh,
        "sync": kwargs or None,
        "seeds": [r["seed"] for r in rs],
        "eval_loss": distribution(finals),
        "gap_vs_dp_per_seed": gap,
        "gap_vs_dp_p50": float(np.median(list(gap.values()))) if gap else None,
        "inner_step_s_per_seed": [r["inner_step_s"] for r in rs],  # noisy: shared cores
        "outer_extra_compute_s": extra,
        "slow_bytes_per_step": sum(t["weight_bytes"] * t["runs"] for t in tr.values()) / total,
        # What the ring sends per device (p = 2): an all-reduce n, an all-gather or all-to-all n/2.
        "slow_wire_bytes_per_step": sum(
            comm_s(t["priced"], 8e-9, dict.fromkeys(alpha, 0.0)) * t["runs"] for t in tr.values()
        )
        / total,
        "slow_bytes_per_inner_step": tr["None"]["weight_bytes"] if "None" in tr else 0,
        "slow_bytes_per_outer_step": {k: t["weight_bytes"] for k, t in tr.items() if k != "None"},
        "weight_syncs_per_step": sum(t["runs"] for t in tr.values() if t["weight_bytes"]) / total,
        "scalar_syncs_per_step": sum(t["scalar_collectives"] * t["runs"] for t in tr.values())
        / total,
        "sim_step_s": {str(g): mean_step(tr, extra, compute, g, alpha, delay) for g in GBPS},
        "speed": lambda g: mean_step(tr, extra, compute, g, alpha, delay),
    }


def summarize(
    runs: list[dict], tr_all: dict, layouts: dict, args, compute_s: float | None = None
) -> dict:
    """Per config: p50/p90/max over seeds, bytes and sync points, simulated step times; the
    DP-equivalent steps, the bandwidth below which it beats DP to its own loss; per bandwidth,
    who trains fastest in DP-equivalent steps per second. `layouts`: name -> (mesh, SyncConfig
    kwargs or None)."""
    import math

    import numpy as np

    alpha = alphas(args)
    measured = float(np.median([r["inner_step_s"] for r in runs]))
    compute = compute_s or measured  # compute_s: a what-if, the outer steps' extra scaled too
    by = {
        n: [r for r in runs if r["config"] == n] for n in dict.fromkeys(r["config"] for r in runs)
    }
    steps_at = [s for s, _ in runs[0]["eval_curve"]]
    curves = {
        n: np.median([[v for _, v in r["eval_curve"]] for r in rs], 0) for n, rs in by.items()
    }
    rows = {
        n: config_row(
            layouts[n], rs, by.get("DP", []), tr_all[n], compute, alpha, compute / measured
        )
        for n, rs in by.items()
    }
    for n, row in rows.items():
        row["curve_p50"] = [[s, float(v)] for s, v in zip(steps_at, curves[n], strict=True)]
        if "DP" in rows:
            eq = steps_to(row["eval_loss"]["p50"], steps_at, curves["DP"])
            row["dp_equivalent_steps"] = eq  # None: DP's own final loss is above it
            ratio = (eq if eq is not None else args.steps) / args.steps
            b = crossover(row["speed"], ratio, rows["DP"]["speed"]) if n != "DP" else None
            row["wins_below_gbps"] = {math.inf: "all", 0.0: "none"}.get(b, b)
    # Per bandwidth: DP-equivalent steps per simulated second (the steps DP needs for a config's
    # loss, over the config's time to it; DP's own rate is 1 / its step), the highest wins.
    rate = {}
    for g in GBPS:
        per = {
            n: (row.get("dp_equivalent_steps") or args.steps) / (args.steps * row["speed"](g))
            for n, row in rows.items()
        }
        rate[str(g)] = {"winner": max(per, key=per.get), "dp_steps_per_s": per}
    for row in rows.values():
        del row["speed"]
    return {"compute_s": compute, "alpha_step_s": alpha, "dp_rate": rate, "configs": rows}


def print_table(summary: dict) -> None:
    rows = summary["configs"]
    print(
        f"\ncompute {summary['compute_s'] * 1e3:.4g} ms/step;  simulated step ms at "
        + ", ".join(f"{g}" for g in GBPS)
        + " Gbit/s"
    )
    head = f"{'config':9s} {'loss p50':>8s} {'p90':>6s} {'max':>6s} {'vs DP':>6s} {'KB/step':>8s}"
    print(head + f" {'KB/outer':>8s} {'sync/st':>7s} {'DP-eq st':>8s}  sim ms/step      wins <Gb/s")
    for n, r in rows.items():
        gap = r["gap_vs_dp_p50"]
        outer = max(r["slow_bytes_per_outer_step"].values(), default=0)
        eq = r.get("dp_equivalent_steps")
        sim = " ".join(f"{v * 1e3:6.4g}" for v in r["sim_step_s"].values())
        wins = r.get("wins_below_gbps", "-") if n != "DP" else "-"
        wins = wins if isinstance(wins, str) else f"{wins:.3g}"
        e = r["eval_loss"]
        print(
            f"{n:9s} {e['p50']:8.4f} {e['p90']:6.3f} {e['max']:6.3f} "
            f"{'-' if gap is None else f'{gap:+.2%}':>6s} {r['slow_bytes_per_step'] / 1e3:8.1f} "
            f"{outer / 1e3:8.1f} {r['weight_syncs_per_step']:7.3f} "
            f"{'>=all' if eq is None else f'{eq:.0f}':>8s}  {sim}  {wins}"
        )
    for g, r in summary["dp_rate"].items():
        best = sorted(r["dp_steps_per_s"].items(), key=lambda x: -x[1])[:3]
        print(
            f"{g:>3s} Gbit/s, DP-equivalent steps/s: " + ", ".join(f"{n} {v:.3g}" for n, v in best)
        )


def plot(panels: list[tuple[dict, str, str]], path: pathlib.Path) -> None:
    """One panel per (summary, Gbit/s key of GBPS, compute label): p50 loss against the
    simulated time of the steps behind each eval point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, (summary, g, label) in zip(axes[0], panels, strict=True):
        for i, (n, r) in enumerate(summary["configs"].items()):
            step_s = r["sim_step_s"][g]
            steps, loss = zip(*r["curve_p50"], strict=True)
            style = "ko-" if n == "DP" else f"C{i}.-"
            ax.plot([s * step_s for s in steps], loss, style, ms=3, label=n)
        ax.set_xlabel(f"simulated wall time (s): {g} Gbit/s slow link, compute {label}")
        ax.set_ylabel("held-out loss, p50 over seeds")
        ax.set_title(f"{g} Gbit/s, {summary['compute_s'] * 1e3:.3g} ms compute per step")
        ax.set_ylim(top=4.0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
