"""jaxdist against the peer baselines on one GPU, side by side, in one device call.

    mkdir -p .peers && cp ../shared/peers/*.py .peers/ && echo /.peers/ >> .git/info/exclude
    # then, on the GPU machine (the device tool), from the repository root:
    PYTHONPATH=. python3 experiments/gpu_vs_peers.py --peers .peers

For each model (GPT-2 124M at batch 32, 1B at batch 8, the peers' exact architecture, and
the Llama-style presets) it runs `jaxdist bench` and the two peers (torch.compile and plain
JAX), prints a table with tokens/s, MFU (against 989 TFLOP/s), peak memory and the ratio to
each peer, and appends every line to experiments/results/gpu_vs_peers.jsonl with the date,
card and versions. Targets (issue 7): >= 1.10x torch.compile at 124M, >= 1.08x at 1B.
"""

import argparse
import datetime
import json
import pathlib
import subprocess
import sys

RUNS = [  # (jaxdist model, batch, peer args or None for jaxdist-only presets)
    ("gpt2-124m", 32, ["--layers", "12", "--d", "768", "--heads", "12", "--seq", "1024"]),
    ("1b", 8, ["--layers", "16", "--d", "2048", "--heads", "16", "--seq", "2048"]),
    ("llama-124m", 32, None),
    ("llama-1b", 8, None),
]


def run_json(cmd: list[str], timeout: int) -> dict | None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode or not lines:
        print(f"FAILED ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default=".peers")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", nargs="*", help="model names to run (default: all)")
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    import jax

    meta = {
        "date": datetime.date.today().isoformat(),
        "card": jax.devices()[0].device_kind,
        "jax": jax.__version__,
    }
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        pass
    out = pathlib.Path(__file__).parent / "results" / "gpu_vs_peers.jsonl"
    rows = []
    for model, batch, peer_args in RUNS:
        if args.only and model not in args.only:
            continue
        ours = run_json(
            [
                sys.executable,
                "-m",
                "jaxdist.cli",
                "bench",
                "--model",
                model,
                "--batch-size",
                str(batch),
                "--steps",
                str(args.steps),
            ],
            args.timeout,
        )
        row = {"model": model, "batch": batch, "jaxdist": ours}
        if peer_args:
            common = [
                *peer_args,
                "--batch",
                str(batch),
                "--steps",
                str(args.steps),
                "--peak",
                "989",
            ]
            row["torch"] = run_json(
                [sys.executable, f"{args.peers}/torch_gpt.py", *common], args.timeout
            )
            row["jax_peer"] = run_json(
                [sys.executable, f"{args.peers}/jax_gpt.py", *common], args.timeout
            )
        rows.append(row)
        with out.open("a") as f:
            f.write(json.dumps({**meta, **row}) + "\n")
    print(
        f"{'model':<12}{'who':<10}{'tok/s':>12}{'MFU':>8}{'mem GB':>9}{'vs torch':>10}{'vs jax':>8}"
    )
    for row in rows:
        ours = row["jaxdist"]
        for who in ("jaxdist", "torch", "jax_peer"):
            r = row.get(who)
            if not r:
                continue
            ratios = ["", ""]
            if who == "jaxdist":
                for i, peer in enumerate(("torch", "jax_peer")):
                    if row.get(peer):
                        ratios[i] = f"{ours['tokens_per_s'] / row[peer]['tokens_per_s']:.2f}x"
            mem = r.get("peak_mem_gb") or r.get("mem_gb") or 0
            print(
                f"{row['model']:<12}{who:<10}{r['tokens_per_s']:>12,.0f}{r['mfu']:>8.1%}"
                f"{mem:>9.1f}{ratios[0]:>10}{ratios[1]:>8}"
            )


if __name__ == "__main__":
    main()
