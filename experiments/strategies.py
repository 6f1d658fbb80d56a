"""Every parallelism strategy against the naive baseline, on the same 8 fake devices.

    python experiments/strategies.py                 # tiny (4 layers), batch 32, 8 CPU devices
    python experiments/strategies.py --steps 40      # longer timing runs

Naive baseline: replicated data parallelism (data=8), the "more devices, same data flow"
layout. Against it, FSDP, tensor, pipeline and expert parallelism alone and combined. For each
layout: step time p50/p90/max over timed steps (after warmup), collective bytes per step per
device from the compiled HLO, XLA's peak memory per device, and the planner's prediction (cpu
preset) beside the measurement, so the cost model is checked where it can be.
On fake CPU devices a collective is a memory copy plus a rendezvous of threads sharing two
cores, so the timings show the coordination overhead of each layout, not a GPU's.
Writes experiments/results/strategies.json and .png.
"""

import argparse
import json
import pathlib
import time

LAYOUTS = [
    # (layout, model, microbatches, schedule)
    ("data=8", "tiny", 1, "1f1b"),
    ("fsdp=8", "tiny", 1, "1f1b"),
    ("data=2,tensor=4", "tiny", 1, "1f1b"),
    ("data=4,fsdp=2", "tiny", 1, "1f1b"),
    ("data=2,fsdp=2,tensor=2", "tiny", 1, "1f1b"),
    ("pipeline=4,data=2", "tiny", 8, "1f1b"),
    ("pipeline=2,data=2,tensor=2", "tiny", 4, "1f1b"),
    ("data=8", "tiny-moe", 1, "1f1b"),
    ("expert=8", "tiny-moe", 1, "1f1b"),
    ("data=2,expert=4", "tiny-moe", 1, "1f1b"),
]


def measure(layout, model, microbatches, schedule, args) -> dict:
    import jax

    from jaxdist.compiled import hlo
    from jaxdist.compiled.memory import xla_peak
    from jaxdist.config import DataConfig, OptimConfig
    from jaxdist.data import TokenBatches
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.mesh import make_mesh
    from jaxdist.metrics.records import distribution
    from jaxdist.optim import make_optimizer
    from jaxdist.planning.inputs import PlanConfig
    from jaxdist.planning.planner import price
    from jaxdist.step import build
    from meshes.presets import STANDARD_RULES
    from models.inventory import plan_model
    from models.presets import get_model_config, model_spec

    mc = get_model_config(model, num_layers=args.layers)
    mesh = make_mesh(layout)
    tx, lr = make_optimizer(OptimConfig(), args.steps + args.warmup)
    step = StepConfig(microbatches, pipeline_schedule=schedule)
    at = Layout.on(mesh, STANDARD_RULES, step, batch_size=args.batch_size, seq_len=mc.seq_len)
    c = build(model_spec(mc).init, tx, lr, at, mesh)
    exe = c.compile_abstract((args.batch_size, mc.seq_len + 1))
    peak = xla_peak(exe.memory_analysis())
    moved = hlo.summarize(hlo.collectives(exe.as_text(), dict(mesh.shape)))
    data = TokenBatches(DataConfig(batch_size=args.batch_size), mc.seq_len, mc.vocab_size)
    state = c.init_fn()
    times, losses = [], []
    for s in range(args.warmup + args.steps):
        batch = jax.device_put(data.batch(s), c.batch_sharding)
        jax.block_until_ready(batch)
        t0 = time.perf_counter()
        state, metrics = exe(state, batch)
        jax.block_until_ready(metrics)
        if s >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(float(metrics["loss"]))
    sizes = {a: n for a, n in mesh.shape.items() if n > 1}
    predicted = price(
        sizes, [plan_model(mc)], STANDARD_RULES, PlanConfig(8, "cpu", args.batch_size, step)
    )
    return {
        "layout": layout,
        "model": model,
        "microbatches": microbatches,
        "step_s": distribution(times),
        "final_loss": losses[-1],
        "collective_bytes": sum(v["bytes"] for v in moved.values()),
        "collectives": {f"{a} {k}": v["bytes"] for (a, k), v in sorted(moved.items())},
        "peak_bytes": peak,
        "predicted_step_s": predicted["step_s"],
        "predicted_peak_bytes": predicted["memory_bytes"]["peak"],
        "predicted_collective_bytes": predicted["comm_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--out", default=None, help="results directory (default: experiments/results)"
    )
    args = parser.parse_args()
    from jaxdist.mesh import setup_devices

    setup_devices("cpu:8")
    rows = []
    for layout, model, m, schedule in LAYOUTS:
        row = measure(layout, model, m, schedule, args)
        naive = next((r for r in rows if r["model"] == model and r["layout"] == "data=8"), row)
        row["vs_naive_p50"] = row["step_s"]["p50"] / naive["step_s"]["p50"]
        row["memory_vs_naive"] = row["peak_bytes"] / naive["peak_bytes"]
        rows.append(row)
        d = row["step_s"]
        print(
            f"{model:9s} {layout:28s} p50 {d['p50'] * 1e3:7.1f} ms  p90 {d['p90'] * 1e3:7.1f}  "
            f"max {d['max'] * 1e3:7.1f}  ({row['vs_naive_p50']:.2f}x naive)  "
            f"moved {row['collective_bytes'] / 1e6:6.2f} MB  peak {row['peak_bytes'] / 1e6:6.1f}"
            f" MB ({row['memory_vs_naive']:.2f}x)  predicted {row['predicted_step_s'] * 1e3:6.1f}"
            " ms",
            flush=True,
        )
    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "strategies.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(rows, out / "strategies.png")


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['layout']}\n({r['model']})" for r in rows]
    x = range(len(rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 5))
    p50 = [r["step_s"]["p50"] * 1e3 for r in rows]
    lo = [0.0] * len(rows)
    hi = [r["step_s"]["max"] * 1e3 - p for p, r in zip(p50, rows, strict=True)]
    a.bar(x, p50, yerr=[lo, hi], capsize=3, color="tab:blue", label="measured p50 (bar to max)")
    a.scatter(x, [r["step_s"]["p90"] * 1e3 for r in rows], color="k", marker="_", s=200,
              label="p90", zorder=3)  # fmt: skip
    a.scatter(x, [r["predicted_step_s"] * 1e3 for r in rows], color="tab:red", marker="x",
              label="planner (cpu preset)", zorder=3)  # fmt: skip
    a.set_ylabel("ms per step")
    a.set_title("step time")
    a.legend(fontsize=8)
    b.bar(x, [r["collective_bytes"] / 1e6 for r in rows], color="tab:orange")
    b.set_ylabel("MB per device per step (HLO)")
    b.set_title("bytes moved")
    c.bar(x, [r["peak_bytes"] / 1e6 for r in rows], color="tab:green", label="XLA")
    c.scatter(x, [r["predicted_peak_bytes"] / 1e6 for r in rows], color="tab:red", marker="x",
              label="planner", zorder=3)  # fmt: skip
    c.set_ylabel("MB per device")
    c.set_title("peak memory")
    c.legend(fontsize=8)
    for ax in (a, b, c):
        ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
