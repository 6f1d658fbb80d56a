"""Context parallelism: all-gather against ring against Ulysses, measured and predicted.

    python experiments/context_parallel.py              # both parts; about 20 min on 2 cores
    python experiments/context_parallel.py --part plan  # the prediction only (seconds)

Part 1, measured: tiny-llama on 8 fake CPU devices (`context=4,fsdp=2`), each strategy, T from
1K to 4K at 16K tokens per step: step time p50/p90/max over the timed steps (--steps, after
two untimed). Fake devices are threads on two cores, so this ranks the strategies' work, not
their links.

Part 2, predicted: Llama-2-7B (MaxText's published setting) on `v5p-16` (8 chips) and 8 H100s,
`context=8`, 64K tokens per step, T from 4K to 128K: the planner's step time and exchanged bytes
per strategy, with the fastest marked and where the order changes (the crossover).

What the planner does not price (so part 2 ranks links, not kernels): ring attention here is
XLA's math, not a fused kernel (splash and cuDNN run all-gather and Ulysses), and its chunks'
compute is not overlapped with the hops in the model; Ulysses' all-to-alls are priced exposed.
"""

import argparse
import json
import statistics
import time
from typing import get_args

from jaxdist.layout import ContextStrategy

STRATEGIES = get_args(ContextStrategy)
KERNEL = {"v5p-16": "splash", "h100": "cudnn"}  # each platform's fused attention


def measured(steps: int) -> list[dict]:
    import jax
    import numpy as np

    from jaxdist.config import OptimConfig
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.mesh import build_mesh, parse_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.step import Vocab, build
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config
    from models.transformer import Transformer

    rows = []
    for T in (1024, 2048, 4096):
        mc = get_model_config("tiny-llama", seq_len=T)
        batch = 8192 // T * 2  # 16K tokens per step at every T
        for strategy in STRATEGIES:
            tx, lr = make_optimizer(OptimConfig(), steps + 2)
            mesh = build_mesh(parse_mesh("context=4,fsdp=2"))
            step = StepConfig(context_strategy=strategy)
            at = Layout.on(mesh, STANDARD_RULES, step, batch_size=batch, seq_len=T)
            init = lambda r, mc=mc: Transformer(mc, r)  # noqa: E731
            jitted = build(init, tx, lr, at, mesh, vocab=Vocab(mc.vocab_size, None))
            tokens = np.random.default_rng(0).integers(0, mc.vocab_size, (batch, T + 1))
            tokens = jax.device_put(tokens.astype(np.int32), jitted.batch_sharding)
            state = jitted.init_fn()
            times = []
            for s in range(steps + 2):  # the first two: compile and warm-up
                t0 = time.perf_counter()
                state, metrics = jitted.step_fn(state, tokens)
                jax.block_until_ready(metrics["loss"])
                if s >= 2:
                    times.append(time.perf_counter() - t0)
            q = statistics.quantiles(times, n=10)
            rows.append(
                {
                    "T": T,
                    "strategy": strategy,
                    "p50_ms": 1e3 * statistics.median(times),
                    "p90_ms": 1e3 * q[-1],
                    "max_ms": 1e3 * max(times),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def predicted() -> list[dict]:
    from jaxdist.layout import StepConfig
    from jaxdist.planning.inputs import PlanConfig
    from jaxdist.planning.planner import plan
    from meshes.presets import STANDARD_RULES
    from models.inventory import plan_model
    from models.presets import get_model_config
    from models.remat import ORDER

    rows = []
    for hardware in ("v5p-16", "h100"):
        for T in (4096, 8192, 16384, 32768, 65536, 131072):
            batch = max(1, 65536 // T)
            at_T = []
            for strategy in STRATEGIES:
                models = [
                    plan_model(
                        get_model_config(
                            "llama2-7b",
                            seq_len=T,
                            remat=remat,
                            compute_dtype="bfloat16",
                            attention=KERNEL[hardware],
                        )
                    )
                    for remat in ORDER
                ]
                step = StepConfig(context_strategy=strategy)
                cfg = PlanConfig(8, hardware, batch, step, mesh=(("context", 8),))
                row = plan(models, STANDARD_RULES, cfg)["layouts"][0]
                at_T.append(
                    {
                        "hardware": hardware,
                        "T": T,
                        "rows": batch,
                        "strategy": strategy,
                        "remat": row["remat"],
                        "step_s": row["step_s"],
                        "comm_GB": row["comm_bytes"] / 1e9,
                        "memory_GB": row["memory_bytes"]["peak"] / 1e9,
                        "fits": row["fits"],
                    }
                )
            best = min(at_T, key=lambda r: r["step_s"])
            for r in at_T:
                r["fastest"] = r is best
            rows += at_T
    return rows


def crossovers(rows: list[dict]) -> list[str]:
    """Where the fastest strategy changes as T grows, per hardware."""
    out = []
    for hardware in dict.fromkeys(r["hardware"] for r in rows):
        best = [(r["T"], r["strategy"]) for r in rows if r["hardware"] == hardware and r["fastest"]]
        for (t0, a), (t1, b) in zip(best, best[1:], strict=False):
            if a != b:
                out.append(f"{hardware}: {a} fastest to T={t0}, {b} from T={t1}")
        if len({s for _, s in best}) == 1:
            out.append(f"{hardware}: {best[0][1]} fastest at every T (no crossover up to 128K)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("both", "measure", "plan"), default="both")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.part in ("both", "measure"):
        from jaxdist.mesh import setup_devices

        setup_devices("cpu:8")
        measured(args.steps)
    if args.part in ("both", "plan"):
        rows = predicted()
        for r in rows:
            mark = " <- fastest" if r["fastest"] else ""
            print(
                f"{r['hardware']:7} T={r['T']:>6} rows={r['rows']:>2} {r['strategy']:10} "
                f"{r['remat']:15} step {r['step_s']:8.3f} s  comm {r['comm_GB']:8.1f} GB  "
                f"mem {r['memory_GB']:6.1f} GB{'' if r['fits'] else ' (does not fit)'}{mark}"
            )
        for line in crossovers(rows):
            print("crossover:", line)


if __name__ == "__main__":
    main()
