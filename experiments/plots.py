"""The figures of the longer studies (scaling_law.py, checkpoint_interval.py), kept apart from
their method: each takes the study's result and writes a PNG."""

import pathlib
import statistics

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(ax, xlabel: str, ylabel: str, title: str, fontsize: int = 7) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=fontsize)


def scaling_law(runs: list[dict], fits: dict, unigram: float, path: pathlib.Path) -> None:
    """Loss against compute per size (with the frontier and its fits), and IsoFLOP profiles."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    models = list(dict.fromkeys(r["model"] for r in runs))
    for i, name in enumerate(models):
        rs = sorted((r for r in runs if r["model"] == name), key=lambda r: r["compute"])
        color = f"C{i}"
        label = f"{name} ({rs[0]['params'] / 1e3:.0f}K)"
        a.plot(
            [r["compute"] for r in rs],
            [r["held_out_loss"] for r in rs],
            "o-",
            color=color,
            label=label,
        )
        # The longest run's training curve, against the compute spent so far.
        longest = rs[-1]
        curve = np.array(longest["train_loss_curve"])
        k = max(1, len(curve) // 50)
        smooth = np.convolve(curve, np.ones(k) / k, mode="valid")
        steps = np.arange(len(smooth)) + k
        per_step = longest["compute"] / longest["steps"]
        a.plot(steps * per_step, smooth, "-", color=color, alpha=0.25, lw=1)
    cmap = plt.get_cmap("viridis")
    levels = sorted({r["level"] for r in runs})
    for j, level in enumerate(levels):
        rs = sorted((r for r in runs if r["level"] == level), key=lambda r: r["params"])
        b.plot(
            [r["params"] for r in rs],
            [r["held_out_loss"] for r in rs],
            "o-",
            color=cmap(j / max(1, len(levels) - 1)),
            label=f"C = {level:.2g}",
        )
    front = fits["frontier"]
    fr = [r for r in runs if {"model": r["model"], "tokens": r["tokens"]} in front]
    fr.sort(key=lambda r: r["compute"])
    C = np.array([r["compute"] for r in fr])
    a.plot(C, [r["held_out_loss"] for r in fr], "ks", mfc="none", ms=10, label="frontier")
    grid = np.geomspace(C.min() / 2, C.max() * 4, 100)
    f = fits.get("frontier_fit")
    if f:
        a.plot(
            grid,
            f["pure"]["a"] * grid ** -f["pure"]["gamma"],
            "k--",
            lw=1,
            label=f"a C^-{f['pure']['gamma']:.3f}",
        )
    wf = f and f["with_floor"]
    if wf and "gamma" in wf:
        a.plot(
            grid,
            wf["a"] * grid ** -wf["gamma"] + wf["l_inf"],
            "k-",
            lw=1,
            label=f"a C^-{wf['gamma']:.3f} + {wf['l_inf']:.2f}",
        )
    a.axhline(unigram, color="gray", ls=":", lw=1, label=f"unigram entropy {unigram:.2f}")
    a.set_xscale("log")
    a.set_yscale("log")
    compute = "training compute C = flops_per_token x tokens (FLOPs)"
    _label(
        a, compute, "held-out loss (nats/byte)", "loss vs compute; faint: longest run's train loss"
    )
    b.set_xscale("log")
    b.set_yscale("log")
    isoflop = "IsoFLOP profiles: each level's minimum is its compute-optimal size"
    _label(b, "parameters N", "held-out loss (nats/byte)", isoflop)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def checkpoint_interval(result: dict, path: pathlib.Path) -> None:
    """Overhead against the interval, beside Young's model; restart overhead kept apart."""
    plt = _pyplot()
    from matplotlib import ticker

    rows = result["rows"]
    taus = np.array([r["tau_s"] for r in rows])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})

    def band(key: str, style: str, label: str, **kw) -> None:
        mean = np.array([r[key]["mean"] for r in rows])
        err = [mean - [r[key]["min"] for r in rows], [r[key]["max"] for r in rows] - mean]
        a.errorbar(taus, mean, yerr=err, fmt=style, capsize=3, label=label, **kw)

    band("lost_work_s", "o-", "lost work (recomputed + in flight)", alpha=0.7)
    band("checkpoint_cost_s", "s-", "checkpoint cost (blocked x saves)", alpha=0.7)
    for t, r in zip(taus, rows, strict=True):  # a save blocks longer once saves queue
        ms = r["blocked_per_save_s"]["mean"] * 1e3
        a.annotate(f"{ms:.0f} ms/save", (t, r["checkpoint_cost_s"]["mean"]), fontsize=6)
    band("lost_plus_checkpoint_s", "D-", "lost work + checkpoint cost", color="k", lw=2)
    band("overhead_measured_s", "^--", "total overhead (measured spans)", color="tab:red")
    # First-order model for the same useful work: T (C / tau + tau / (2 M)).
    grid = np.geomspace(taus.min() * 0.8, taus.max() * 1.25, 100)
    useful = result["config"]["steps"] * statistics.fmean(r["step_time_s"] for r in rows)
    c, m = result["t_write_s"], result["mtbf_s"]
    a.plot(grid, useful * (c / grid + grid / (2 * m)), ":", color="grey", label="Young model")
    a.axvline(result["young_daly_s"], color="tab:green", ls="--", label="sqrt(2 T_write MTBF)")
    fit = result["measured_minimum"]["fit"]
    if fit:
        a.axvline(fit["tau_s"], color="tab:purple", ls=":", label="fitted measured optimum")
    a.set_xscale("log")
    a.set_ylim(0, 1.7 * max(r["lost_plus_checkpoint_s"]["max"] for r in rows))  # legend room
    a.set_xlabel("checkpoint interval tau = steps x step time (s)")
    a.set_ylabel(f"seconds per {result['config']['steps']}-step run")
    a.set_title(
        f"T_write {c * 1e3:.0f} ms, MTBF {m:.0f} s, {result['config']['trials']} trials "
        "(bars: min-max)"
    )
    a.legend(fontsize=7, loc="upper center", ncol=2)
    st = statistics.fmean(r["step_time_s"] for r in rows)
    top = a.secondary_xaxis("top", functions=(lambda t: t / st, lambda n: n * st))
    top.set_xlabel("steps (approx.)", fontsize=8)
    for axis in (a.xaxis, top.xaxis):
        axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        axis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        axis.set_tick_params(which="minor", labelsize=6)

    x = np.arange(len(rows))
    restart = [r["restart_total_s"]["mean"] for r in rows]
    b.bar(x, restart, color="tab:orange", alpha=0.7, label="restart overhead (all failures)")
    b.bar(x, [r["lost_plus_checkpoint_s"]["mean"] for r in rows], color="k", alpha=0.6, width=0.4)
    b.plot([], [], "s", color="k", alpha=0.6, label="lost work + checkpoint cost")
    for i, r in enumerate(rows):
        b.text(i, restart[i], f"{r['failures']['mean']:.1f} fail.", ha="center", va="bottom")
    b.set_xticks(x, [str(r["every"]) for r in rows])
    b.set_xlabel("--checkpoint-every")
    b.set_ylabel("seconds per run (mean)")
    b.set_title(
        f"restart {result['restart_per_failure_s']['p50']:.1f} s per failure, kept apart",
    )
    b.set_ylim(0, 1.3 * max(restart))
    b.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def pipeline_bubble(rows: list[dict], p: int, path: pathlib.Path) -> None:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for sched, mark in (("gpipe", "o"), ("1f1b", "s"), ("interleaved", "^")):
        rs = [r for r in rows if r["schedule"] == sched]
        ms = [r["m"] for r in rs]
        a.plot(
            ms,
            [r["idle_plus_exposed_comm"] for r in rs],
            mark + "-",
            label=f"{sched}: idle + exposed comm",
        )
        b.plot(ms, [r["temp_mb"] for r in rs], mark + "-", label=sched)
        if sched != "1f1b":  # 1f1b's theory line is gpipe's
            v = rs[0]["v"]
            label = "(p-1)/(m+p-1)" if v == 1 else f"(p-1)/(vm+p-1), v={v}"
            a.plot(ms, [r["bubble_theory"] for r in rs], "k--" if v == 1 else "k:", label=label)
    _label(a, "microbatches m", "share of step", f"bubble, p={p}", fontsize=8)
    _label(b, "microbatches m", "XLA temp MB per device", "activation memory", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
