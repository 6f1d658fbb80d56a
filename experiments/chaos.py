"""Chaos study: a 300-step two-process run on a bad day, unattended, with and without the local
checkpoint tier.

    python experiments/chaos.py                  # about 15 minutes on a 2-core CPU host
    python experiments/chaos.py --steps 120      # a shorter day

Six faults of five kinds are injected into one run under `jaxdist launch --max-restarts`
(`train --fault`, each fires once): kill -9 of process 1, process 0 stuck (declared hung by
`--hang-timeout`), SIGTERM to process 1 alone, an I/O error in process 1's restore, a full disk
in process 0's save, kill -9 of process 0. Nobody intervenes. Checked: the run finishes (exit
0); its losses equal an uninterrupted run's (rtol 1e-5); no checkpoint is set aside or lost;
`jaxdist goodput` names each restart's cause and the work each fault cost (steps recomputed,
the time between attempts, restores). The same day is run twice: without a local tier, and with
one in a tmpfs (`--local-checkpoint-dir`), Young-Daly choosing both tiers' intervals from their
measured save costs and an MTBF set to the day's fault rate. Writes
experiments/results/chaos.json and chaos.png (a timeline of both runs' attempts).

    python experiments/chaos.py --groups         # replica groups against whole-job restarts

The replica-group day (`--groups`, jaxdist.groups): three groups of tiny-llama (H = 4), each
one process of two CPU devices, trained twice on the same schedule of faults: as a fleet
(`launch --groups 3`, each group its own job, a lost group restarted alone) and as one job of
three processes (`--mesh replica=3,data=2` in one program, whole-job restarts from its
checkpoints). The schedule is the chaos study's: faults at fixed fractions of the run (each
fires when the run first reaches it, so each configuration meets all of them): kill -9 of group
(process) 1 at 13%, group 2 stopped (SIGSTOP) for 20 s at 27%, SIGTERM to group 1 at 40% (a
preemption notice: it saves and exits), the lighthouse killed at 50% (the fleet only: the job
has none), kill -9 of group 0 at 80%. `--schedule burst` is the first study's instead: four
faults in the first 95 s from the first step, none after. Each configuration also runs without
faults; goodput = the share of the groups' rounds trained x the fault-free wall / the wall.
Writes experiments/results/chaos_groups.json (chaos_groups_burst.json).
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
JAXDIST = [sys.executable, "-m", "jaxdist.cli"]


def faults(steps: int) -> list[str]:
    """Six faults at fixed fractions of the run: (kind, fraction, process[, seconds])."""
    at = lambda f: max(1, int(steps * f))  # noqa: E731
    specs = [
        f"kill:{at(0.13)}:1",
        f"stall:{at(0.27)}:0:3600",
        f"term:{at(0.40)}:1",
        f"restore-error:{at(0.40)}:1",  # the restore after the SIGTERM's save
        f"disk-full:{at(0.60)}:0",
        f"kill:{at(0.80)}:0",
    ]
    return [a for s in specs for a in ("--fault", s)]


def train(steps: int, run_dir: pathlib.Path, *extra: str) -> list[str]:
    return [
        *("train", "--model", "tiny", "--mesh", "data=2,fsdp=2,tensor=2"),
        *("--steps", str(steps), "--batch-size", "8", "--seq-len", "32", "--log-every", "1"),
        *("--run-dir", str(run_dir)),
        *extra,
    ]


def records(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    # The last attempt's value of a recomputed step wins.
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def saves(run_dir: pathlib.Path) -> dict:
    """Each tier's saves (steps) and the intervals Young-Daly chose (steps), in order."""
    out = {}
    for r in records(run_dir):
        if r.get("event") in ("save", "checkpoint_interval"):
            tier = out.setdefault(r.get("tier", "persistent"), {"saved": [], "intervals": []})
            if r["event"] == "save":
                tier["saved"].append(r["step"])
            else:
                tier["intervals"].append(r["interval_steps"])
    return out


def run_day(name: str, steps: int, work: pathlib.Path, extra: list[str]) -> dict:
    run_dir = work / name
    day = [*train(steps, run_dir, *faults(steps), *extra)]
    day += ["--hang-timeout", "15", "--heartbeat-timeout", "5", "--mtbf-hours-per-device"]
    # The day's fault rate: six faults in about five minutes on 8 devices.
    day += [f"{6 * 60 * 8 / 3600 / 6:.4f}"]
    cmd = [*JAXDIST, "launch", "--processes", "2", "--devices-per-process", "4"]
    cmd += ["--max-restarts", "8", "--", *day]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - t0
    (work / f"{name}.log").write_text(p.stdout + p.stderr)
    out = p.stdout + p.stderr
    from jaxdist.metrics import goodput

    rep = goodput.read_report(run_dir)
    resumed = [int(s) for s in re.findall(r"\[p0\] resuming from checkpoint step (\d+)", out)]
    checkpoints = sorted(q.name for q in (run_dir / "checkpoints").iterdir())
    return {
        "name": name,
        "exit": p.returncode,
        "wall_s": wall,
        "restarts": [r["cause"] for r in _restarts(run_dir)],
        "resumed_from": resumed,
        "local_resumes": len(re.findall(r"\[p0\] resuming from .*\(local tier\)", out)),
        "checkpoints": checkpoints,
        "set_aside": [c for c in checkpoints if ".damaged" in c],
        "goodput": rep["goodput"],
        "parts_s": rep["parts_s"],
        "recomputed_steps": rep["recomputed_steps"],
        "attempts": [
            {k: a[k] for k in ("attempt", "process_start", "end", "first_step", "last_step")}
            | {"cause": a.get("restart_cause"), "parts_s": a["parts_s"]}
            for a in rep["attempts"]
        ],
        "saves": saves(run_dir),
        "losses": losses(run_dir),
    }


def _restarts(run_dir: pathlib.Path) -> list[dict]:
    from jaxdist.metrics.goodput import read_restarts

    return read_restarts(run_dir)


def short(cause: str) -> str:
    """A restart's cause in a few words, for the plot (several: joined by "; then ")."""
    if "; then " in cause:
        return " + ".join(short(c) for c in cause.split("; then "))
    if " stopped: " in cause:
        who = cause.split(" stopped: ")[0]
        what = (
            "restore error"
            if "restored" in cause
            else "save failed"
            if "written" in cause
            else "error"
        )
        return f"{who}: {what}"
    if cause.startswith("hang declared"):
        return "hang: " + cause.split("stuck: ")[-1].split(" on ")[0] + " stuck"
    if cause.startswith("a signal stopped"):
        return "SIGTERM: saved, stopped"
    return cause.replace("killed by ", "")


def plot(days: list[dict], out: pathlib.Path) -> None:
    """One row per run: each attempt a bar from its process start to its last record, split
    into its parts; the cause of each restart written at its end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxdist.metrics.goodput import ALL_PARTS, COLORS

    fig, ax = plt.subplots(figsize=(13, 1.6 + 1.4 * len(days)))
    for row, day in enumerate(days):
        t0 = day["attempts"][0]["process_start"]
        for a in day["attempts"]:
            left = a["process_start"] - t0
            for part in ALL_PARTS[:-1]:
                w = a["parts_s"][part]
                ax.barh(row, w, left=left, color=COLORS[part], height=0.5)
                left += w
            if a["cause"]:
                ax.annotate(
                    short(a["cause"]), (left, row + 0.3), fontsize=7, rotation=-25,
                    rotation_mode="anchor", ha="left", va="top",
                )  # fmt: skip
    ax.set_yticks(range(len(days)), [d["name"] for d in days])
    ax.set_ylim(len(days) - 0.2, -0.5)
    ax.set_xlabel("seconds since the first process started (gaps: between attempts)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[p]) for p in ALL_PARTS[:-1]]
    ax.legend(
        handles, ALL_PARTS[:-1], fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5)
    )
    ax.set_title("a bad day, unattended: attempts and what each second went to")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


# --- Replica groups against whole-job restarts ---------------------------------------------------

# The chaos study's schedule (faults() above): faults at fixed fractions of the run, so each
# configuration meets every one however long it takes. (fraction, kind, group or process).
# Its two injected disk faults (a restore's I/O error, a save's full disk) are train flags
# that every group of a fleet would take as its own, so the faults here come from outside as
# signals; the lighthouse kill takes the restore error's slot and hits the fleet only.
GROUP_FAULTS = (
    (0.13, "kill", 1), (0.27, "stop", 2), (0.40, "term", 1), (0.50, "lighthouse", None),
    (0.80, "kill", 0),
)  # fmt: skip
# The first study's schedule (--schedule burst): four faults in the first 95 s of each run,
# timed from its first step, none after. (seconds, kind, group or process).
BURST_FAULTS = ((20.0, "kill", 2), (45.0, "stop", 1), (75.0, "lighthouse", None), (95.0, "kill", 0))
STOP_S = 20.0
SCHEDULES = {"fractions": GROUP_FAULTS, "burst": BURST_FAULTS}


def group_train(steps: int, run_dir: pathlib.Path) -> list[str]:
    return [
        *("train", "--model", "tiny-llama", "--mesh", "replica=3,data=2", "--sync-every", "4"),
        *("--steps", str(steps), "--batch-size", "12", "--log-every", "4"),
        *("--run-dir", str(run_dir), "--checkpoint-every", "8"),
        # The outer step the README's figures were measured with (before --outer-lr auto).
        *("--outer-lr", "0.7", "--outer-momentum", "0.9"),
    ]


def _job_pids(launcher: int) -> dict:
    """The job's processes (launch's children), by their --process-id (the lighthouse: -1)."""
    found = {}
    for child in pathlib.Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        args = pathlib.Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"--process-id" in args:
            found[int(args[args.index(b"--process-id") + 1])] = int(child)
    return found


def _fleet_pid(run_dir: pathlib.Path, group) -> int:
    lines = [json.loads(x) for x in (run_dir / "launch.jsonl").read_text().splitlines()]
    return [x["pid"] for x in lines if x["group"] == group][-1]


def _signal(pid: int, sig) -> None:
    import os

    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _progress(run_dir: pathlib.Path, fleet: bool) -> int:
    """The furthest step logged (by any group): -1 before the first."""
    found = -1
    for metrics in run_dir.glob("groups/*/metrics.jsonl" if fleet else "metrics.jsonl"):
        for line in reversed(metrics.read_text().splitlines()):
            if '"loss"' in line:
                found = max(found, json.loads(line)["step"])
                break
    return found


def _day(name: str, fleet: bool, steps: int, work: pathlib.Path, schedule) -> dict:
    """One run under `schedule` (GROUP_FAULTS, BURST_FAULTS or none), timed from its first
    step."""
    import signal as sig

    run_dir = work / name
    launch = [*JAXDIST, "launch", "--processes", "1" if fleet else "3"]
    launch += ["--devices-per-process", "2", "--max-restarts", "4"]
    launch += ["--groups", "3"] if fleet else []
    extra = [] if fleet else ["--hang-timeout", "60"]  # the first outer steps compile slowly
    log = (work / f"{name}.log").open("w")
    t0 = time.monotonic()
    p = subprocess.Popen(
        [*launch, "--", *group_train(steps, run_dir), *extra], stdout=log, stderr=log, cwd=ROOT
    )
    done = []
    while p.poll() is None and _progress(run_dir, fleet) < 0:
        time.sleep(0.2)
    t_first = time.monotonic()
    by_time = schedule is BURST_FAULTS
    for at, kind, who in schedule:
        # The fault is due at a time from the first step, or when the run first reaches a
        # fraction of its steps (its furthest step: a restarted job passes it again).
        while p.poll() is None and not (
            time.monotonic() - t_first >= at if by_time else _progress(run_dir, fleet) >= at * steps
        ):
            time.sleep(0.1)
        if p.poll() is not None or (kind == "lighthouse" and not fleet):
            continue
        pid = (
            _fleet_pid(run_dir, "lighthouse" if kind == "lighthouse" else who)
            if fleet
            else _job_pids(p.pid).get(who)
        )
        if pid is None:
            continue
        at_s = round(time.monotonic() - t_first, 1)
        at_step = _progress(run_dir, fleet)
        if kind == "stop":
            _signal(pid, sig.SIGSTOP)
            time.sleep(STOP_S)
            _signal(pid, sig.SIGCONT)
        else:
            _signal(pid, sig.SIGTERM if kind == "term" else sig.SIGKILL)
        done.append({"at_s": at_s, "at_step": at_step, "fault": kind, "who": who})
    p.wait()
    wall = time.monotonic() - t0
    return {"name": name, "exit": p.returncode, "wall_s": wall, "faults": done}


def _last_loss(run_dir: pathlib.Path, steps: int, fleet: bool) -> float:
    dirs = [run_dir / "groups" / str(g) for g in range(3)] if fleet else [run_dir]
    values = [r["loss"] for d in dirs for r in records(d) if "loss" in r and r["step"] >= steps - 8]
    return sum(values) / len(values)


def groups_study(steps: int, work: pathlib.Path, out: pathlib.Path, schedule: str) -> None:
    from jaxdist.groups import accounting
    from jaxdist.metrics import goodput

    rows = []
    for fleet in (True, False):
        kind = "replica groups" if fleet else "whole-job restarts"
        calm = _day(f"{kind}, no faults", fleet, steps, work, ())
        day = _day(kind, fleet, steps, work, SCHEDULES[schedule])
        run_dir = work / kind
        if fleet:
            rep = accounting.fleet_report(run_dir)
            share, committed, lost = rep["work_share"], rep["rounds_committed"], rep["tokens_lost"]
        else:
            rep = goodput.read_report(run_dir)
            share, committed = 1.0, steps // 4
            lost = rep["recomputed_steps"] * 12 * 128
            day["jaxdist_goodput"] = rep["goodput"]
        day.update(
            calm_wall_s=calm["wall_s"], work_share=share, committed_rounds=committed,
            tokens_lost=lost, goodput=share * calm["wall_s"] / day["wall_s"],
            final_loss=_last_loss(run_dir, steps, fleet), report=rep,
        )  # fmt: skip
        rows.append(day)
        print(
            f"{kind}: exit {day['exit']}, wall {day['wall_s']:.0f} s (no faults "
            f"{calm['wall_s']:.0f} s), rounds committed {committed}, work share {share:.1%}, "
            f"goodput {day['goodput']:.1%}, tokens lost {lost:,}, final loss "
            f"{day['final_loss']:.4f}; faults at (s, step, kind, group): "
            f"{[(f['at_s'], f['at_step'], f['fault'], f['who']) for f in day['faults']]}"
        )
    ratio = rows[0]["goodput"] / rows[1]["goodput"]
    print(f"replica groups' goodput / whole-job restarts': {ratio:.2f}x")
    name = "chaos_groups.json" if schedule == "fractions" else f"chaos_groups_{schedule}.json"
    record = {"steps": steps, "schedule": schedule, "days": rows}
    (out / name).write_text(json.dumps(record, indent=2))
    print(f"wrote {out / name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", action="store_true", help="replica groups vs whole-job restarts")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--schedule", choices=sorted(SCHEDULES), default="fractions",
        help="--groups: the chaos study's fractions of the run, or the first study's burst",
    )  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--keep", default=None, help="run here and keep the run directories")
    ap.add_argument("--plot", default=None, help="only redraw the plot of this chaos.json")
    args = ap.parse_args()
    if args.plot:
        plot(
            json.loads(pathlib.Path(args.plot).read_text())["days"],
            pathlib.Path(args.plot).with_suffix(".png"),
        )
        return
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.groups:
        with tempfile.TemporaryDirectory() as tmp:
            work = pathlib.Path(args.keep or tmp)
            work.mkdir(parents=True, exist_ok=True)
            groups_study(args.steps, work, out, args.schedule)
        return
    shm_root = "/dev/shm" if pathlib.Path("/dev/shm").is_dir() else None  # a tmpfs, if any
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm_root) as shm:
        work = pathlib.Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        ref_dir = work / "reference"
        # The same two processes, uninterrupted: one process of 8 devices reduces in another
        # order, which 300 steps of training amplify past 1e-5.
        launch = [*JAXDIST, "launch", "--processes", "2", "--devices-per-process", "4", "--"]
        ref = subprocess.run(
            [*launch, *train(args.steps, ref_dir)], capture_output=True, text=True, cwd=ROOT
        )
        assert ref.returncode == 0, ref.stderr[-3000:]
        reference = losses(ref_dir)
        local = ["--local-checkpoint-dir", str(pathlib.Path(shm) / "local")]
        days = [
            run_day("persistent only", args.steps, work, []),
            run_day("with a local tier", args.steps, work, local),
        ]
    rows = []
    for day in days:
        got = day.pop("losses")
        same = sorted(got) == sorted(reference) and all(
            abs(got[s] - reference[s]) <= 1e-5 * abs(reference[s]) for s in reference
        )
        worst = max(abs(got.get(s, float("inf")) - reference[s]) for s in reference)
        differ = [s for s in sorted(reference) if got.get(s) != reference[s]]
        day["losses_equal_uninterrupted"] = same
        day["max_abs_loss_diff"] = worst
        day["first_step_not_bitwise"] = differ[0] if differ else None
        rows.append(day)
        print(
            f"{day['name']}: exit {day['exit']}, {len(day['restarts'])} restarts, resumed from "
            f"{day['resumed_from']} ({day['local_resumes']} from the local tier), goodput "
            f"{day['goodput']:.1%} of {day['wall_s']:.0f} s, {day['recomputed_steps']} steps "
            f"recomputed, set aside {day['set_aside'] or 'none'}, losses equal: {same} "
            f"(max diff {worst:.2e})"
        )
        for cause in day["restarts"]:
            print(f"    restart after: {cause}")
    (out / "chaos.json").write_text(json.dumps({"steps": args.steps, "days": rows}, indent=2))
    plot(rows, out / "chaos.png")
    print(f"wrote {out / 'chaos.json'} and {out / 'chaos.png'}")


if __name__ == "__main__":
    main()
