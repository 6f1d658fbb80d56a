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

Per run, from the run's own metrics.jsonl (every step logged, each record stamped with the
wall-clock time it was written; the records a process appended are its segment's):
  lost work        per failure, the steps the killed process ran that the next one runs again,
                   times the run's mean step time, plus the unlogged work in flight (kill - last
                   step record, less a save logged after it). The resume names every logged
                   step at or past the restored one ("steps a..b are recomputed", computed here
                   from the records as the loop does), so two failures before new progress
                   name the same steps twice: its sum over-counts and is kept only for
                   comparison.
  checkpoint cost  the time each save blocked the loop, as the loop logged it per save
                   ("save" events), summed over every save any process reached, lost ones
                   included; each process's first save pays its setup here.
  restart overhead launch -> first step record, less one step and the saves logged before
                   it: process start, restore, compile from the persistent cache. A constant
                   per failure, reported apart so that it does not swamp the interval's effect.
  total overhead   the segments' measured training spans less steps x mean step time: the
                   cross-check of lost work + checkpoint cost.
Failures strike only while a process trains (the clock starts at each process's first step
record), so restarts cost every interval the same per failure. The optimum is also located by
fitting a / tau + b * tau to all runs' lost work + checkpoint cost.
Writes experiments/results/checkpoint_interval.json and .png.
"""

import argparse
import json
import math
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import plots

from jaxdist.checkpoint.interval import daly_interval_s

# Past 4x, tau nears the MTBF; under 1/4x, saves queue behind the previous commit and a run
# takes twice as long (at 1/8x every save blocked ~3x T_write in a trial run).
FACTORS = (1 / 4, 1 / 2, 1, 2, 4)


class Records:
    """The records one process appends to a run's metrics.jsonl, read as they arrive.

    Starts where the file's complete lines end: a killed writer's partial last line is cut off
    there by the next process's MetricsLog before it appends."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.pos = path.read_bytes().rfind(b"\n") + 1 if path.exists() else 0
        self.all: list[dict] = []

    def poll(self) -> list[dict]:
        """The complete records written since the last poll."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.pos)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]
        self.pos += len(data)
        new = [json.loads(line) for line in data.splitlines()]
        self.all += new
        return new


def segment(cmd: list[str], run_dir: pathlib.Path, gap_s: float | None) -> dict:
    """One process; SIGKILLed gap_s seconds after its first step record, unless it ends first."""
    records = Records(run_dir / "metrics.jsonl")
    t_launch = time.time()  # wall clock, as the records' own stamps
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        first = None
        while first is None and p.poll() is None:
            first = next((r for r in records.poll() if "loss" in r), None)
            time.sleep(0.005)
        t_kill = None
        if first is not None and gap_s is not None:
            try:
                p.wait(timeout=max(0.0, first["time"] + gap_s - time.time()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                t_kill = time.time()
        rc = p.wait()
        t_end = time.time()
        killed = t_kill is not None and rc == -signal.SIGKILL  # else it finished before the blow
        if not killed and rc != 0:
            err.seek(0)
            tail = "\n".join(err.read().splitlines()[-30:])
            raise RuntimeError(f"training exited {rc}: {' '.join(cmd)}\n{tail}")
    records.poll()
    steps = [(r["time"], r["step"], r["step_time_s"]) for r in records.all if "loss" in r]
    saves = [
        (r["time"], r["step"], r["blocked_s"]) for r in records.all if r.get("event") == "save"
    ]
    return {
        "t_launch": t_launch,
        "t_first": steps[0][0] if steps else None,
        "t_kill": t_kill,
        "t_end": t_end,
        "killed": killed,
        "steps": steps,
        "saves": saves,
    }


def run_interval(base: list[str], run_dir: pathlib.Path, every: int, steps: int, gaps) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*base, "--checkpoint-every", str(every), "--run-dir", str(run_dir)]
    segs = []
    t0 = time.perf_counter()
    while not segs or segs[-1]["killed"]:
        if len(segs) >= len(gaps):
            raise RuntimeError(f"every {every}: {len(segs)} failures and not done; raise --mtbf-s")
        segs.append(segment(cmd, run_dir, gaps[len(segs)]))
    wall = time.perf_counter() - t0

    # Steady step time: each segment's first step holds the compile, its second warm-up.
    step_s = [dt for seg in segs for _, _, dt in seg["steps"][2:]]
    step_mean = statistics.fmean(step_s)
    blocked = [b for seg in segs for _, _, b in seg["saves"]]
    lost, restarts, spans, early, restored, named = [], [], 0.0, 0.0, [], 0
    logged: list[int] = []  # steps logged by the processes so far
    for i, seg in enumerate(segs):
        # A process resumes at its restored state's step; one that logged no step resumed with
        # none left to run (a kill after the last step, before exit).
        start = seg["steps"][0][1] if seg["steps"] else steps
        if i:
            restored.append(start - 1)  # the checkpoint of step s holds s + 1 steps
            # The resume names logged steps start..max(logged) as recomputed (jaxdist.train).
            named += max(0, max(logged, default=-1) - start + 1)
        logged += [s for _, s, _ in seg["steps"]]
        if not seg["steps"]:
            restarts.append(seg["t_end"] - seg["t_launch"])
            continue
        (t_a, _, _), (t_b, last, _) = seg["steps"][0], seg["steps"][-1]
        # Step s's save runs after step s is dispatched, before step s's record: the saves
        # logged before the first record are the start-up's, those after the last in flight.
        before = sum(b for t, _, b in seg["saves"] if t <= t_a)
        after = sum(b for t, _, b in seg["saves"] if t > t_b)
        early += before
        if i:
            restarts.append(t_a - seg["t_launch"] - step_mean - before)
        if seg["killed"]:
            nxt = segs[i + 1]["steps"]
            redo_from = max(start, nxt[0][1] if nxt else steps)
            # The steps this process ran that the next one runs again, and the one in flight.
            lost.append(max(0, last - redo_from + 1) * step_mean + seg["t_kill"] - t_b - after)
        spans += (seg["t_kill"] if seg["killed"] else t_b) - (t_a - step_mean)
    summary = json.loads((run_dir / "summary.json").read_text())
    ran = [seg for seg in segs if seg["steps"]]
    return {
        "every": every,
        "wall_s": wall,
        "failures": len(segs) - 1,
        "step_time_s": step_mean,
        "step_time_p50_s": statistics.median(step_s),
        "tau_s": every * step_mean,
        "recomputed_steps": sum(len(seg["steps"]) for seg in ran) - steps,
        "log_named_recomputed_steps": named,
        "lost_per_failure_s": lost,
        "lost_work_s": sum(lost),
        "saves": len(blocked),
        "blocked_per_save_s": statistics.fmean(blocked),
        "checkpoint_cost_s": sum(blocked),
        "lost_plus_checkpoint_s": sum(lost) + sum(blocked),
        "final_segment_blocked_s": summary["checkpoint_blocked_s"],
        "restart_s": restarts,
        "startup_s": segs[0]["t_first"] - segs[0]["t_launch"] - step_mean,
        "training_span_s": spans,
        "overhead_measured_s": spans - steps * step_mean + early,
        "restored_steps": restored,
        "gaps_used_s": [float(g) for g in gaps[: len(segs) - 1]],
    }


def calibrate(base: list[str], run_dir: pathlib.Path, every: int) -> dict:
    """An uninterrupted run: step time and the time a save blocks the loop (and a warm cache)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*base, "--checkpoint-every", str(every), "--run-dir", str(run_dir)]
    seg = segment(cmd, run_dir, None)
    s = json.loads((run_dir / "summary.json").read_text())
    blocked = [b for _, _, b in seg["saves"]]  # each save as the loop logged it
    return {
        "every": every,
        "wall_s": seg["t_end"] - seg["t_launch"],
        "step_time_s": s["step_time_s"],
        "loop_blocked_s": s["checkpoint_blocked_s"],
        "loop_blocked_total_s": s["checkpoint_blocked_total_s"],
        "blocked_per_save_s": blocked,
        # The first save of a process also pays one-off setup, as jaxdist.checkpoint.interval
        # assumes.
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
    ap.add_argument("--out", default=None, help="results directory (default: experiments/results)")
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
    cal = calibrate(base, root / "calibration", args.calibrate_every)
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
            r = run_interval(base, root / f"t{trial}-every{every}", every, args.steps, gaps)
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
    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint_interval.json").write_text(json.dumps(result, indent=1))
    plots.checkpoint_interval(result, out / "checkpoint_interval.png")
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


if __name__ == "__main__":
    main()
