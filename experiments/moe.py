"""Aux-loss-free bias balancing against the auxiliary balance loss (issue #55): expert load and
held-out loss over seeds.

    python experiments/moe.py                              # 2 methods x 3 seeds x 300 steps
    python experiments/moe.py --seeds 0 --steps 50         # a quick look

The tiny-moe preset with DeepSeek-V3's router (sigmoid scores, top 2 of 8 experts, weights
renormalized) on one CPU device, dispatched without drops (capacity E/K). Two methods, each at
DeepSeek's setting: `aux`, the Switch balance loss at coefficient 0.01 and no bias; `bias`, the
selection bias moved by 0.001 x sign(mean load - load) each step (jaxdist.optim) with a tiny
balance loss (1e-4) beside it. Per seed both start from the same weights and read the same
batches. Reported per seed and method: max/mean expert load (the largest over layers and
experts of load / its layer's mean) averaged over the last 10 steps, and the held-out loss
(jaxdist.evaluation.evaluate on the first epoch's last 64 batches, 131,072 tokens, which no run
reaches; 4 batches were too few to tell the methods apart).
Writes results/moe.json.

The compiled check (`compiled`): Qwen3-30B-A3B's train step (its published config, dropless by
default) compiled from this host for a TPU v5p slice and for H100s, per layout: peak memory per
device, bytes sent per collective kind, matmul FLOPs per step, and the experts' share (their
grouped GEMMs' FLOPs and the exchange's bytes, counted in the compiled program) against what
the routed tokens themselves need. Writes results/moe_compiled.json.

    python experiments/moe.py compiled                     # v5p-16 (8 chips) and h100:8
    python experiments/moe.py compiled --targets v5p-16 --meshes fsdp=8

The routed tokens' own, per device and step (t tokens per device, K experts per token, L MoE
layers, D embed, F an expert's width, SwiGLU's 3 matrices): expert FLOPs = passes x 2 x t x K x
3 x D x F x L, passes 3 (forward, and backward twice the forward) plus 1 under remat `full` (the
forward again); dispatch bytes = exchanges x t x K x D x 2 bytes (bf16) x L, exchanges 4 (out to
the experts and back, forward and backward) plus 2 under remat `full`, where experts are split
over devices (none otherwise).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

METHODS = {
    "aux": dict(balance_coef=0.01),
    "bias": dict(balance_coef=1e-4, router_bias=True, bias_update_rate=0.001),
}
ROUTER = dict(scoring="sigmoid", capacity_factor=4.0)


def run(method: str, seed: int, args) -> dict:
    import jax
    import numpy as np

    from jaxdist.config import DataConfig, OptimConfig
    from jaxdist.data import TokenBatches
    from jaxdist.evaluation import evaluate
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.mesh import make_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    mc = get_model_config(args.model, **ROUTER, **METHODS[method])
    mesh = make_mesh("single")
    tx, lr = make_optimizer(OptimConfig(), args.steps)
    layout = Layout.on(
        mesh, STANDARD_RULES, StepConfig(), batch_size=args.batch_size, seq_len=mc.seq_len
    )
    jitted = build(model_spec(mc).init, tx, lr, layout, mesh, seed=seed)
    data = TokenBatches(
        DataConfig(batch_size=args.batch_size, seed=seed), mc.seq_len, mc.vocab_size
    )
    epoch_steps = data.num_windows // args.batch_size
    held_out = [epoch_steps - 1 - i for i in range(args.eval_batches)]
    if held_out[-1] < args.steps:
        raise SystemExit(f"{args.steps} steps read into the held-out tail of the epoch")
    state, load_max = jitted.init_fn(), []
    t0 = time.perf_counter()
    for s in range(args.steps):
        state, metrics = jitted.step_fn(state, jax.device_put(data.batch(s), jitted.batch_sharding))
        load_max.append(float(metrics["moe_load_max"]))
    return {
        "method": method,
        "seed": seed,
        "load_max_over_mean": float(np.mean(load_max[-10:])),
        "eval_loss": evaluate(jitted, jitted.weights(state), data, held_out),
        "run_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--eval-batches", type=int, default=64)
    ap.add_argument("--out", default=None, help="results directory (default: experiments/results)")
    args = ap.parse_args()
    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    print(f"{'seed':>4s} {'method':>6s} {'max/mean load':>14s} {'eval loss':>10s}")
    for seed in (int(s) for s in args.seeds.split(",")):
        for method in METHODS:
            runs.append(r := run(method, seed, args))
            print(f"{seed:>4d} {method:>6s} {r['load_max_over_mean']:14.3f} {r['eval_loss']:10.4f}")
            (out / "moe.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        load = sum(r["load_max_over_mean"] for r in mine) / len(mine)
        loss = sum(r["eval_loss"] for r in mine) / len(mine)
        print(f"mean {method:>6s} {load:14.3f} {loss:10.4f}")


def routed(cfg: dict, batch: int, seq: int, devices: int, remat: str, n_ep: int) -> dict:
    """What the routed tokens need per device and step (the module's docstring)."""
    t, K, L = batch * seq / devices, cfg["num_experts_per_tok"], cfg["num_hidden_layers"]
    D, F = cfg["hidden_size"], cfg["moe_intermediate_size"]
    again = remat == "full"
    flops = (3 + again) * 2 * t * K * 3 * D * F * L
    exchanges = (4 + 2 * again) if n_ep > 1 else 0
    return {"expert_flops": flops, "dispatch_bytes": exchanges * t * K * D * 2 * L}


def _sent(rows: list[dict], mesh: dict) -> dict:
    """Bytes each device sends per step by collective kind: all-gather, reduce-scatter and
    (ragged) all-to-all x (n-1)/n of the buffer, all-reduce x 2(n-1)/n, others x 1."""
    out: dict[str, float] = {}
    for r in rows:
        n = 1
        for a in r["axis"].split("+"):
            n *= mesh.get(a, 1)
        share = (n - 1) / n
        weight = {"all-reduce": 2 * share, "collective-permute": 1.0}.get(r["kind"], share)
        out[r["kind"]] = out.get(r["kind"], 0.0) + r["bytes"] * weight
    return out


def compile_one(args, target: str, mesh: str) -> dict:
    """`jaxdist train --compile-only --target` in a fresh interpreter (one compile's memory at a
    time); its JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "jaxdist.cli", "train", "--model", args.model]
        cmd += ["--mesh", mesh, "--batch-size", str(args.batch_size)]
        cmd += ["--seq-len", str(args.seq_len), "--remat", args.remat]
        cmd += ["--compile-only", "--target", target, "--json", str(path)]
        print("$ jaxdist " + " ".join(cmd[3:-2]), flush=True)
        root = str(pathlib.Path(__file__).resolve().parent.parent)
        env = os.environ | {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
        # XLA's own word where its rematerialization could not bring the program under the
        # device's memory (the GPU compiler says so, then goes on).
        remat = [x for x in done.stderr.splitlines() if "Can't reduce memory use" in x]
        said = {"xla_remat": remat[-1].split("] ", 1)[-1][:300]} if remat else {}
        command = {"target": target, "mesh": mesh, "command": "jaxdist " + " ".join(cmd[3:-2])}
        if not path.exists():
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return command | said | {"error": tail[:400]}
        report = json.loads(path.read_text())
    return command | said | report


def compiled_row(args, cfg: dict, report: dict) -> dict:
    """One compiled layout's figures beside the routed tokens' own."""
    if "error" in report:
        return report
    mesh = report["mesh"]
    said = {"xla_remat": report["xla_remat"]} if "xla_remat" in report else {}
    devices = 1
    for n in mesh.values():
        devices *= n
    need = routed(cfg, args.batch_size, args.seq_len, devices, args.remat, mesh.get("expert", 1))
    mm = report["matmuls"]
    # The exchange: the ragged all-to-alls over the expert axes (TPU, GPU); the all-to-alls
    # there where there are none (XLA:CPU's blocks). Their routing tables (int32 [n_ep, 2, E /
    # n_ep] all-to-alls, under a MB a step) and the head's all-to-all are not the tokens'.
    over = [r for r in report["collectives"] if "expert" in r["axis"].split("+")]
    kind = "ragged-all-to-all" if any(r["kind"] == "ragged-all-to-all" for r in over) else ""
    exchange = sum(r["bytes"] for r in over if r["kind"] == (kind or "all-to-all"))
    return {
        "target": report["target"],
        "device_kind": report["device_kind"],
        "mesh": mesh,
        "command": report["command"],
        "peak_gb": report["per_device_bytes"]["peak_estimate"] / 1e9,
        "peak_gib": report["per_device_bytes"]["peak_estimate"] / 2**30,
        "fits": report.get("fits"),
        "sent_gb": {k: v / 1e9 for k, v in _sent(report["collectives"], mesh).items()},
        "collectives": report["collectives"],
        "matmul_tflop_per_device": mm["total"] / 1e12,
        "matmul_tflop_per_step": mm["total"] * devices / 1e12,
        "matmuls_by_op_tflop": {k: v / 1e12 for k, v in mm["by_op"].items()},
        "expert_tflop": mm["ragged_dots"] / 1e12,
        "routed_expert_tflop": need["expert_flops"] / 1e12,
        "expert_flops_ratio": mm["ragged_dots"] / need["expert_flops"],
        "exchange_gb": exchange / 1e9,
        "routed_dispatch_gb": need["dispatch_bytes"] / 1e9,
        "dispatch_ratio": exchange / need["dispatch_bytes"] if need["dispatch_bytes"] else None,
        "compile_s": report["compile_s"],
        # The exchange's asynchronous collectives and the matmuls the schedule runs under them
        # (jaxdist.compiled.overlap): the overlap the compiled program promises.
        "exchange_overlap": {
            k: v for k, v in report.get("scheduled_under", {}).items() if "expert" in k
        },
    } | said


def compiled_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="the compiled check of a MoE model (docstring)")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--targets", default="v5p-16,h100:8")
    ap.add_argument("--meshes", default="fsdp=8;fsdp=2,expert=4", help="; between meshes")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--remat", default="full")
    ap.add_argument("--out", default=None, help="results directory (default: experiments/results)")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(__file__).resolve().parent.parent
    cfg = json.loads((root / "models" / "configs" / f"{args.model}.json").read_text())
    rows = []
    for target in args.targets.split(","):
        for mesh in args.meshes.split(";"):
            rows.append(compiled_row(args, cfg, compile_one(args, target, mesh)))
            (out / "moe_compiled.json").write_text(
                json.dumps({"args": vars(args), "rows": rows}, indent=1)
            )
    print(
        f"{'target':>8s} {'mesh':>16s} {'peak GB':>8s} {'sent GB':>8s} {'TFLOP/dev':>9s} "
        f"{'expert':>7s} {'routed':>7s} {'x':>5s} {'a2a GB':>7s} {'routed':>7s} {'x':>5s} "
        f"{'overlap':>13s}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['target']:>8s} {r['mesh']:>16s} error: {r['error']}")
            continue
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1)
        ratio = f"{r['dispatch_ratio']:5.2f}" if r["dispatch_ratio"] is not None else "    -"
        print(
            f"{r['target']:>8s} {mesh:>16s} {r['peak_gb']:8.2f} {sum(r['sent_gb'].values()):8.1f} "
            f"{r['matmul_tflop_per_device']:9.1f} {r['expert_tflop']:7.1f} "
            f"{r['routed_expert_tflop']:7.1f} {r['expert_flops_ratio']:5.2f} "
            f"{r['exchange_gb']:7.2f} {r['routed_dispatch_gb']:7.2f} {ratio} {_overlap(r)}"
        )


def _overlap(row: dict) -> str:
    """`k/n T TF`: k of the exchange's n asynchronous collectives a step have matmuls scheduled
    under them, T TFLOP in all; `-` where the exchange has none that are asynchronous."""
    # The tokens' exchange: the ragged all-to-alls where there are any (not the routing
    # tables' small int32 all-to-alls, which XLA's GPU compiler schedules long matmuls under).
    kinds = row["exchange_overlap"]
    ragged = [v for k, v in kinds.items() if k.endswith(" ragged-all-to-all")]
    found = ragged or [v for k, v in kinds.items() if k.endswith(" all-to-all")]
    if not found:
        return "            -"
    n, k = sum(v["count"] for v in found), sum(v["with_compute"] for v in found)
    return f"{k:>4d}/{n:<4d}{sum(v['flops_under'] for v in found) / 1e12:4.1f}TF"


if __name__ == "__main__":
    if sys.argv[1:2] == ["compiled"]:
        compiled_main(sys.argv[2:])
    else:
        main()
