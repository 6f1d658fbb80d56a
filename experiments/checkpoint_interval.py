"""Checkpoint interval under injected failures: measured overhead against Young-Daly.

    python experiments/checkpoint_interval.py      # tiny, 1 CPU device, batch 4: ~6 min, 2 cores

A real `jaxdist train` process is killed with SIGKILL at exponentially distributed moments
(mean `--mtbf-s` seconds of training) and relaunched with the same command and `--run-dir`, so
that it resumes from its newest committed checkpoint, until `--steps` steps are done; this for
5 values of `--checkpoint-every` from 1/4 to 4 times the Young-Daly optimum
sqrt(2 * T_write * MTBF), with T_write the mean time a save blocks the loop in an uninterrupted
calibration run (its first save, which pays one-off setup, left out). Every interval of a
trial meets the same failure draws (common random numbers); trials differ in seed and run the
intervals in alternating order, against drift in the machine's load.

Per run, from the step lines the children print (timestamped as they arrive):
  lost work        per failure, the steps the killed process ran that the next one runs again,
                   times the run's mean step time, plus the unlogged work in flight (kill - last
                   line). The resume line ("steps a..b are recomputed") names every logged step
                   at or past the restored one, so two failures before new progress name the
                   same steps twice: its sum over-counts and is kept only for comparison.
  checkpoint cost  blocked time per save x the saves every process reached, lost ones included.
                   The loop leaves a save out of its step times, so a line's spacing beyond its
                   step time is that save's blocked time (it matches the loop's own total to a
                   few ms); each process's first save pays its setup here.
  restart overhead launch -> first step line, less one step (and a save due at that step):
                   process start, restore, compile from the persistent cache. A constant per
                   failure, reported apart so that it does not swamp the interval's effect.
  total overhead   the segments' measured training spans less steps x mean step time: the
                   cross-check of lost work + checkpoint cost, needing no save count.
Failures strike only while a process trains (the clock starts at each process's first step),
so restarts cost every interval the same per failure. The optimum is also located by fitting
a / tau + b * tau to all runs' lost work + checkpoint cost.
Writes experiments/results/checkpoint_interval.json and .png.
"""

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxdist.checkpoint.interval import daly_interval_s  # noqa: E402 - after the path insert

STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+\S+\s+grad_norm\s+\S+\s+([\d.]+) ms")
RESUMED = re.compile(r"resuming from checkpoint step (\d+) .*? at step (\d+)")
RECOMPUTED = re.compile(r"steps (\d+)\.\.(\d+) are recomputed")
# Past 4x, tau nears the MTBF; under 1/4x, saves queue behind the previous commit and a run
# takes twice as long (at 1/8x every save blocked ~3x T_write in a trial run).
FACTORS = (1 / 4, 1 / 2, 1, 2, 4)
# Wide enough that the resume line is never wrapped by rich, so the regexes see it whole.
CHILD_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}


def segment(cmd: list[str], gap_s: float | None) -> dict:
    """One process; SIGKILLed gap_s seconds after its first step line, unless it ends first."""
    t_launch = time.perf_counter()
    p = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=CHILD_ENV, cwd=ROOT
    )
    lines: list[tuple[float, str]] = []
    first: list[float] = []
    started = threading.Event()

    def read() -> None:
        for line in p.stderr:
            now = time.perf_counter()
            lines.append((now, line.rstrip("\n")))
            if not first and STEP_LINE.match(line):
                first.append(now)
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not started.wait(0.005) and p.poll() is None:
        pass
    t_kill = None
    if first and gap_s is not None:
        try:
            p.wait(timeout=max(0.0, first[0] + gap_s - time.perf_counter()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            t_kill = time.perf_counter()
    rc = p.wait()
    reader.join()
    t_end = time.perf_counter()
    killed = t_kill is not None and rc == -signal.SIGKILL  # else it finished before the blow
    if not killed and rc != 0:
        tail = "\n".join(text for _, text in lines[-30:])
        raise RuntimeError(f"training exited {rc}: {' '.join(cmd)}\n{tail}")
    steps = [(t, int(m[1]), float(m[2]) / 1e3) for t, x in lines if (m := STEP_LINE.match(x))]
    text = " ".join(x for _, x in lines)
    resumed, recomputed = RESUMED.search(text), RECOMPUTED.search(text)
    return {
        "t_launch": t_launch,
        "t_first": first[0] if first else None,
        "t_kill": t_kill,
        "t_end": t_end,
        "killed": killed,
        "steps": steps,
        "restored_step": int(resumed[1]) if resumed else None,
        "log_recomputed": (int(recomputed[1]), int(recomputed[2])) if recomputed else (None, None),
    }


def saves_in(first: int, last: int, every: int, steps: int) -> int:
    """Saves the loop makes at steps first..last: s + 1 a multiple of `every`, and the final."""
    if last < first:
        return 0
    return (last + 1) // every - first // every + (first <= steps - 1 <= last and steps % every > 0)


def run_interval(
    base: list[str], run_dir: pathlib.Path, every: int, steps: int, gaps, fallback_save_s: float
) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*base, "--checkpoint-every", str(every), "--run-dir", str(run_dir)]
    segs = []
    t0 = time.perf_counter()
    while not segs or segs[-1]["killed"]:
        if len(segs) >= len(gaps):
            raise RuntimeError(f"every {every}: {len(segs)} failures and not done; raise --mtbf-s")
        segs.append(segment(cmd, gaps[len(segs)]))
    wall = time.perf_counter() - t0

    # Steady step time: each segment's first step holds the compile, its second warm-up.
    step_s = [dt for seg in segs for _, _, dt in seg["steps"][2:]]
    step_mean = statistics.fmean(step_s)
    ran = [seg for seg in segs if seg["steps"]]
    # Step s's save runs between lines s-1 and s, and the loop leaves it out of its step time:
    # what the lines' spacing holds beyond the step times is the saves' blocked time.
    blocked = sum(
        seg["steps"][-1][0] - seg["steps"][0][0] - sum(dt for _, _, dt in seg["steps"][1:])
        for seg in ran
    )
    timed = sum(saves_in(seg["steps"][0][1] + 1, seg["steps"][-1][1], every, steps) for seg in ran)
    per_save = blocked / timed if timed else fallback_save_s
    lost, restarts, spans, saves, early = [], [], 0.0, 0, 0
    for i, seg in enumerate(segs):
        if not seg["steps"]:  # a kill after the last step, before exit: resumed with none left
            restarts.append(seg["t_end"] - seg["t_launch"])
            continue
        (t_a, start, _), (t_b, last, _) = seg["steps"][0], seg["steps"][-1]
        saves += saves_in(start, last, every, steps)
        # Launch -> first line: start-up, one step, and a save if that step is due one.
        early += saves_in(start, start, every, steps)
        if i:
            up = seg["t_first"] - seg["t_launch"] - step_mean
            restarts.append(up - per_save * saves_in(start, start, every, steps))
        if seg["killed"]:
            nxt = segs[i + 1]["steps"]
            redo_from = max(start, nxt[0][1] if nxt else steps)
            # The steps this process ran that the next one runs again, and the one in flight.
            lost.append(max(0, last - redo_from + 1) * step_mean + seg["t_kill"] - t_b)
        spans += (seg["t_kill"] if seg["killed"] else t_b) - (t_a - step_mean)
    summary = json.loads((run_dir / "summary.json").read_text())
    # The resume line names every logged step at or past the restored one, including steps an
    # earlier resume already named when a failure struck before new progress: summed over
    # restarts it over-counts, so it is kept only for comparison.
    log_named = sum(b - a + 1 for a, b in (s["log_recomputed"] for s in segs) if a is not None)
    return {
        "every": every,
        "wall_s": wall,
        "failures": len(segs) - 1,
        "step_time_s": step_mean,
        "step_time_p50_s": statistics.median(step_s),
        "tau_s": every * step_mean,
        "recomputed_steps": sum(len(seg["steps"]) for seg in ran) - steps,
        "log_named_recomputed_steps": log_named,
        "lost_per_failure_s": lost,
        "lost_work_s": sum(lost),
        "saves": saves,
        "blocked_per_save_s": per_save,
        "saves_timed": timed,
        "checkpoint_cost_s": saves * per_save,
        "lost_plus_checkpoint_s": sum(lost) + saves * per_save,
        "final_segment_blocked_s": summary["checkpoint_blocked_s"],
        "restart_s": restarts,
        "startup_s": segs[0]["t_first"] - segs[0]["t_launch"] - step_mean,
        "training_span_s": spans,
        "overhead_measured_s": spans - steps * step_mean + early * per_save,
        "restored_steps": [s["restored_step"] for s in segs[1:]],
        "gaps_used_s": [float(g) for g in gaps[: len(segs) - 1]],
    }


def calibrate(base: list[str], run_dir: pathlib.Path, every: int, steps: int) -> dict:
    """An uninterrupted run: step time and the time a save blocks the loop (and a warm cache)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    seg = segment([*base, "--checkpoint-every", str(every), "--run-dir", str(run_dir)], None)
    s = json.loads((run_dir / "summary.json").read_text())
    lines = seg["steps"]
    # Each save alone, as in the run's accounting: a line's spacing beyond its step time.
    blocked = [
        lines[i][0] - lines[i - 1][0] - lines[i][2]
        for i in range(1, len(lines))
        if saves_in(lines[i][1], lines[i][1], every, steps)
    ]
    return {
        "every": every,
        "wall_s": seg["t_end"] - seg["t_launch"],
        "step_time_s": s["step_time_s"],
        "loop_blocked_s": s["checkpoint_blocked_s"],
        "loop_blocked_total_s": s["checkpoint_blocked_total_s"],
        "blocked_per_save_s": blocked,
        # The first save of a process also pays one-off setup, as jaxdist.interval assumes.
        "t_write_s": statistics.fmean(blocked[1:]),
        "compile_and_first_step_s": s["compile_and_first_step_s"],
    }


def fit_optimum(taus: list[float], ys: list[float]) -> dict | None:
    """Least squares y = a / tau + b * tau + c, the first-order model's shape, c for the costs
    per failure that do not scale with tau (commit lag, work in flight); optimum sqrt(a/b)."""
    x = np.array([[1 / t, t, 1.0] for t in taus])
    (a, b, c), *_ = np.linalg.lstsq(x, np.array(ys), rcond=None)
    if c < 0:  # a negative constant is not a cost: the fit under c >= 0 then has c = 0
        (a, b), *_ = np.linalg.lstsq(x[:, :2], np.array(ys), rcond=None)
        c = 0.0
    if a <= 0 or b <= 0:
        return None
    return {"a": float(a), "b": float(b), "c": float(c), "tau_s": float(math.sqrt(a / b))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--devices", default="cpu:1")
    ap.add_argument("--mesh", default="single")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--mtbf-s", type=float, default=5.0, help="mean seconds of training per kill")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="failure draws; trial k uses seed + k")
    ap.add_argument("--calibrate-every", type=int, default=20)
    ap.add_argument("--dir", default=None, help="run directories (default: a temp dir)")
    args = ap.parse_args()

    t_all = time.perf_counter()
    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="jaxdist-interval-"))
    root.mkdir(parents=True, exist_ok=True)
    base = [
        sys.executable,
        "-m",
        "jaxdist.cli",
        "train",
        *("--model", args.model, "--devices", args.devices, "--mesh", args.mesh),
        *("--steps", str(args.steps), "--batch-size", str(args.batch_size)),
        *("--log-every", "1", "--seed", "0"),
        # A cache of its own: filled by the calibration run, so no restart recompiles.
        *("--compile-cache", str(root / "xla-cache")),
    ]
    cal = calibrate(base, root / "calibration", args.calibrate_every, args.steps)
    t_write = cal["t_write_s"]
    step_cal = cal["step_time_s"]["mean"]
    mtbf = args.mtbf_s
    young_s = math.sqrt(2 * t_write * mtbf)
    daly_s = daly_interval_s(t_write, mtbf)
    young_steps = young_s / step_cal
    intervals = sorted({max(1, round(young_steps * f)) for f in FACTORS})
    print(
        f"calibration: step {step_cal * 1e3:.1f} ms, save blocks {t_write * 1e3:.1f} ms; "
        f"MTBF {mtbf:.1f} s -> Young-Daly {young_s:.2f} s = {young_steps:.1f} steps "
        f"(Daly {daly_s:.2f} s); sweeping every {intervals}",
        file=sys.stderr,
    )

    runs = []
    for trial in range(args.trials):
        rng = np.random.default_rng(args.seed + trial)
        gaps = rng.exponential(mtbf, size=200)  # the same draws for every interval of a trial
        order = intervals if trial % 2 == 0 else intervals[::-1]
        for every in order:
            r = run_interval(
                base, root / f"t{trial}-every{every}", every, args.steps, gaps, t_write
            )
            r["trial"] = trial
            runs.append(r)
            print(
                f"trial {trial} every {every:3d}: wall {r['wall_s']:6.1f} s, "
                f"{r['failures']} failures, recomputed {r['recomputed_steps']} steps "
                f"(log names {r['log_named_recomputed_steps']}), "
                f"{r['saves']} saves, restarts {sum(r['restart_s']):.1f} s, "
                f"measured overhead {r['overhead_measured_s']:.2f} s",
                file=sys.stderr,
            )

    def spread(values: list[float]) -> dict:
        return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}

    rows = []
    for every in intervals:
        rs = [r for r in runs if r["every"] == every]
        rows.append(
            {
                "every": every,
                "tau_s": statistics.fmean(r["tau_s"] for r in rs),
                "step_time_s": statistics.fmean(r["step_time_s"] for r in rs),
                "failures": spread([r["failures"] for r in rs]),
                **{
                    k: spread([r[k] for r in rs])
                    for k in (
                        "lost_work_s",
                        "blocked_per_save_s",
                        "checkpoint_cost_s",
                        "lost_plus_checkpoint_s",
                        "overhead_measured_s",
                        "wall_s",
                    )
                },
                "restart_total_s": spread([sum(r["restart_s"]) for r in rs]),
            }
        )
    best = min(rows, key=lambda row: row["lost_plus_checkpoint_s"]["mean"])
    best_measured = min(rows, key=lambda row: row["overhead_measured_s"]["mean"])
    per_trial_best = [
        min((r for r in runs if r["trial"] == t), key=lambda r: r["lost_plus_checkpoint_s"])[
            "every"
        ]
        for t in range(args.trials)
    ]
    fit = fit_optimum([r["tau_s"] for r in runs], [r["lost_plus_checkpoint_s"] for r in runs])
    restarts = [x for r in runs for x in r["restart_s"]]
    result = {
        "command": "python experiments/checkpoint_interval.py " + " ".join(sys.argv[1:]),
        "config": {
            k: getattr(args, k)
            for k in ("model", "devices", "mesh", "batch_size", "steps", "mtbf_s", "trials", "seed")
        },
        "calibration": cal,
        "t_write_s": t_write,
        "mtbf_s": mtbf,
        "young_daly_s": young_s,
        "young_daly_steps": young_steps,
        "daly_s": daly_s,
        "intervals": intervals,
        "restart_per_failure_s": {
            "p50": statistics.median(restarts),
            "min": min(restarts),
            "max": max(restarts),
            "n": len(restarts),
        },
        "measured_minimum": {
            "lost_plus_checkpoint_every": best["every"],
            "lost_plus_checkpoint_tau_s": best["tau_s"],
            "over_young_daly": best["tau_s"] / young_s,
            "per_trial_every": per_trial_best,
            "overhead_measured_every": best_measured["every"],
            "fit": fit,
            "fit_over_young_daly": fit["tau_s"] / young_s if fit else None,
        },
        "rows": rows,
        "runs": runs,
        "runtime_s": time.perf_counter() - t_all,
    }
    out = pathlib.Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "checkpoint_interval.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "checkpoint_interval.png")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    m = result["measured_minimum"]
    fitted = f"{fit['tau_s']:.2f} s = {m['fit_over_young_daly']:.2f}x" if fit else "none"
    print(
        f"T_write {t_write * 1e3:.1f} ms, MTBF {mtbf:.1f} s: Young-Daly {young_s:.2f} s "
        f"({young_steps:.1f} steps); measured minimum of lost work + checkpoint cost at every "
        f"{best['every']} ({best['tau_s']:.2f} s = {m['over_young_daly']:.2f}x Young-Daly; "
        f"per trial: every {per_trial_best}); fitted a/tau + b*tau optimum {fitted}; "
        f"restart {result['restart_per_failure_s']['p50']:.2f} s per failure; "
        f"{result['runtime_s']:.0f} s in all",
        file=sys.stderr,
    )


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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


if __name__ == "__main__":
    main()
