"""The README's picture: one training step on 8 devices, where every millisecond went.

    python experiments/step_breakdown.py                 # tiny, data=2,fsdp=2,tensor=2, cpu:8

Trains a few steps with `--profile`, then draws the traced step as a timeline per device
(compute, collectives hidden under compute, collectives exposed, memory copies, idle) beside
`jaxdist profile`'s own breakdown of it (breakdown.json), so the picture is the parser's answer
laid over the raw trace. Writes experiments/results/step_breakdown.png and .json. On fake CPU
devices the devices are threads sharing the host's cores: the picture shows what the parser
sees, not what a GPU fleet would do.
"""

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from jaxdist.profiling import spans, xplane

RESULTS = pathlib.Path(__file__).parent / "results"
COLORS = {
    "compute": "#4c72b0",
    "hidden": "#9ecae1",
    "exposed": "#dd8452",
    "memcpy": "#55a868",
    "idle": "#eeeeee",
}


def train(args, run_dir: pathlib.Path) -> None:
    subprocess.run(
        [
            *(sys.executable, "-m", "jaxdist.cli", "train"),
            *("--model", args.model, "--mesh", args.mesh, "--devices", "cpu:8"),
            *("--steps", str(args.step + 3), "--profile", f"{args.step}:{args.step + 1}"),
            *("--batch-size", "16", "--log-every", "1", "--run-dir", str(run_dir)),
        ],
        check=True,
    )


def timeline(trace: xplane.Trace, step: int) -> tuple[float, dict[int, dict[str, list]]]:
    """Each device's intervals in the step's window, in ms from its start, by what they are."""
    (num, w0, w1), *_ = [w for w in xplane.step_windows(trace) if w[0] == step]
    out: dict[int, dict[str, list]] = {}
    for d in sorted({e.device for e in trace.events}):
        mine = [e for e in trace.events if e.device == d and e.start < w1 and e.end > w0]
        by = {
            k: spans.clip([(e.start, e.end) for e in mine if e.kind == k], w0, w1)
            for k in ("compute", "collective", "memcpy")
        }
        compute = spans.union(by["compute"])
        comm = spans.union(by["collective"])
        parts = {
            "compute": compute,
            "hidden": spans.intersect(comm, compute),
            "exposed": spans.subtract(comm, compute),
            "memcpy": spans.subtract(spans.union(by["memcpy"]), spans.union(compute + comm)),
        }
        out[d] = {k: [((a - w0) / 1e6, (b - a) / 1e6) for a, b in v] for k, v in parts.items()}
    return (w1 - w0) / 1e6, out


def draw(window_ms: float, lanes: dict, rows: list[dict], title: str, path: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 1.2]}, sharey=True
    )
    for d, parts in lanes.items():
        ax1.broken_barh([(0, window_ms)], (d - 0.4, 0.8), color=COLORS["idle"])
        for kind in ("compute", "hidden", "exposed", "memcpy"):
            ax1.broken_barh(parts[kind], (d - 0.4, 0.8), color=COLORS[kind])
    ax1.set_xlim(0, window_ms)
    ax1.set_xlabel("ms into the step")
    ax1.set_ylabel("device")
    ax1.set_yticks(sorted(lanes))
    ax1.invert_yaxis()
    ax1.set_title(title, fontsize=10)
    fields = [
        ("compute_s", "compute"),
        ("comm_overlapped_s", "hidden"),
        ("comm_exposed_s", "exposed"),
        ("memcpy_exposed_s", "memcpy"),
        ("idle_s", "idle"),
    ]
    for r in rows:
        left = 0.0
        for key, kind in fields:
            width = r[key] * 1e3 if kind != "hidden" else 0.0  # hidden lies inside compute
            ax2.barh(r["device"], width, left=left, color=COLORS[kind], height=0.8)
            left += width
    ax2.set_xlabel("ms, as jaxdist profile splits it")
    ax2.set_title("compute + exposed comm + memcpy + idle", fontsize=10)
    names = {
        "compute": "compute",
        "hidden": "communication hidden under compute",
        "exposed": "communication exposed",
        "memcpy": "memory copies exposed",
        "idle": "idle",
    }
    handles = [Patch(color=COLORS[k], label=v) for k, v in names.items()]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    ap.add_argument("--step", type=int, default=6, help="the step to trace and draw")
    ap.add_argument("--run-dir", default=None, help="default: a temporary directory")
    args = ap.parse_args()
    run_dir = pathlib.Path(args.run_dir or tempfile.mkdtemp(prefix="jaxdist-breakdown-"))
    train(args, run_dir)
    report = json.loads((run_dir / "profile" / "breakdown.json").read_text())
    rows = [r for r in report["steps"] if r["step"] == args.step]
    window_ms, lanes = timeline(xplane.load(run_dir / "profile"), args.step)
    RESULTS.mkdir(exist_ok=True)
    title = f"{args.model} on {args.mesh}, 8 fake CPU devices: step {args.step}"
    draw(window_ms, lanes, rows, title, RESULTS / "step_breakdown.png")
    keep = ("device", "step_s", "compute_s", "comm_overlapped_s", "comm_exposed_s", "idle_s")
    out = {
        "command": " ".join(sys.argv),
        "mesh": args.mesh,
        "model": args.model,
        "steps": [{k: r[k] for k in keep} for r in rows],
    }
    (RESULTS / "step_breakdown.json").write_text(json.dumps(out, indent=1) + "\n")
    for r in out["steps"]:  # in ms
        print({k: round(v * 1e3, 2) if k.endswith("_s") else v for k, v in r.items()})


if __name__ == "__main__":
    main()
