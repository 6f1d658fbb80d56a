"""Pipeline bubble and activation memory, measured against theory.

    python experiments/pipeline_bubble.py    # tiny, 8 layers, pipeline=4,data=2; ~5 min on 2 cores
    python experiments/pipeline_bubble.py --multiples 1,2 --out bubble-results   # m = p, 2p only

For p = 4 stages and m in {p, 2p, 4p, 8p} microbatches, for GPipe, 1F1B and interleaved 1F1B
with v = 2 virtual stages: the bubble the textbook predicts, (p-1)/(vm+p-1) of the ticks (v = 1
for GPipe and 1F1B); the idle share of the schedule's ticks; the idle share of a traced step as
the profile parser measures it (per device, averaged); and the temporary memory XLA's memory
analysis reports for the compiled step. 1F1B should hold its memory flat as m grows (at most p
microbatch inputs per stage) while GPipe's grows with m; interleaved should halve the bubble
for more buffered inputs. Ticks are v times shorter when interleaved (a chunk, not a stage).
Beside the bubble, the communication of the compiled step (its HLO, each branch of the tick
counted on the ticks that run it): the pipeline's permutes per tick, both ways, idle ticks
included, and the bytes the stage's weights move over the batch axes, once per step (the
gradient reduction of jaxdist.parallel.stage_weights), with the count of those collectives.
Writes experiments/results/pipeline_bubble.json and .png.
"""

import argparse
import json
import os
import pathlib
import tempfile

import plots

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
).strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--multiples", default="1,2,4,8", help="microbatches m = k * p for these k")
    ap.add_argument("--out", default=None, help="results directory (default: experiments/results)")
    args = ap.parse_args()
    from jaxdist.mesh import setup_devices

    setup_devices("cpu:8")
    import jax
    import numpy as np

    from jaxdist.compiled import hlo
    from jaxdist.config import DataConfig, OptimConfig
    from jaxdist.data import TokenBatches
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.mesh import make_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.parallel.pipeline import branch_share
    from jaxdist.parallel.schedules import make_schedule
    from jaxdist.profiling.breakdown import breakdown
    from jaxdist.profiling.xplane import load
    from jaxdist.step import build
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    p, layout = 4, "pipeline=4,data=2"
    mc = get_model_config("tiny", num_layers=8)
    mesh = make_mesh(layout)
    rows = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for m in (int(k) * p for k in args.multiples.split(",")):
            batch = 2 * m  # one row per data shard per microbatch
            tx, lr = make_optimizer(OptimConfig(), 10)
            step = StepConfig(m, pipeline_schedule=schedule, virtual_stages=v)
            at = Layout.on(mesh, STANDARD_RULES, step, batch_size=batch, seq_len=mc.seq_len)
            c = build(model_spec(mc).init, tx, lr, at, mesh)
            data = TokenBatches(DataConfig(batch_size=batch), mc.seq_len, mc.vocab_size)
            exe = c.compile_abstract((batch, mc.seq_len + 1))
            temp = exe.memory_analysis().temp_size_in_bytes
            state = c.init_fn()
            for s in range(2):
                state, _ = exe(state, jax.device_put(data.batch(s), c.batch_sharding))
            jax.block_until_ready(state)
            trace_dir = tempfile.mkdtemp(prefix="jaxdist-bubble-")
            jax.profiler.start_trace(trace_dir)
            with jax.profiler.StepTraceAnnotation("train", step_num=2):
                state, metrics = exe(state, jax.device_put(data.batch(2), c.batch_sharding))
                jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
            rep = breakdown(load(trace_dir))
            idle = float(np.mean([r["idle_s"] / r["step_s"] for r in rep["steps"]]))
            # Every tick ends in permutes, so a stage with nothing to do waits inside them for
            # its busy neighbours: on CPU the bubble shows as exposed communication, not idle.
            waiting = float(
                np.mean([(r["idle_s"] + r["comm_exposed_s"]) / r["step_s"] for r in rep["steps"]])
            )
            sched = make_schedule(schedule, p, m, v)
            found = hlo.collectives(exe.as_text(), dict(mesh.shape), branch_share(sched))
            permutes = [x for x in found if x.kind == "collective-permute"]
            weights = [x for x in found if "data" in x.axes and x.bytes > 64]  # not scalars
            rows.append(
                {
                    "schedule": schedule,
                    "p": p,
                    "m": m,
                    "v": v,
                    "bubble_theory": (p - 1) / (v * m + p - 1),
                    "bubble_schedule": sched.bubble(),
                    "idle_measured": idle,
                    "idle_plus_exposed_comm": waiting,
                    "temp_mb": temp / 1e6,
                    # buffer slots per stage (stash): v chunks x capacity each
                    "inputs_held": v * sched.capacity,
                    "step_s": rep["summary"]["mean_per_device"]["step_s"],
                    "ticks": sched.ticks,
                    "permute_bytes_per_tick": sum(x.bytes * x.executions for x in permutes)
                    / sched.ticks,
                    "weight_bytes_per_step": sum(x.bytes * x.executions for x in weights),
                    "weight_collectives_per_step": sum(x.executions for x in weights),
                }
            )
            print(json.dumps(rows[-1]))
    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_bubble.json").write_text(json.dumps(rows, indent=1))
    plots.pipeline_bubble(rows, p, out / "pipeline_bubble.png")


if __name__ == "__main__":
    main()
