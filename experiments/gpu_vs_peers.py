"""jaxdist against the peer baselines on one GPU, side by side.

    mkdir -p .peers && cp ../shared/peers/*.py .peers/ && echo /.peers/ >> .git/info/exclude
    # then, on the GPU machine (the device tool), from the repository root:
    PYTHONPATH=. python3 experiments/gpu_vs_peers.py --peers .peers

For each model (GPT-2 124M at batch 32, 1B at batch 8: the peers' exact architecture; and the
Llama-style presets) it runs `jaxdist bench` and the two peers (torch.compile and plain JAX),
each in its own process (a process's peak memory cannot be reset), prints tokens/s, MFU
(against 989 TFLOP/s), peak memory in GiB (the peers' unit) and the ratio to each peer, and
appends every row to experiments/results/gpu_vs_peers.jsonl with the date, card and versions.
Targets (issue 29): >= 1.10x torch.compile at 124M and >= 1.08x at 1B, peak memory no higher.
experiments/h200.py runs the same functions inside its one device call.
"""

import argparse
import datetime
import json
import pathlib
import subprocess
import sys

# The peers' flags for the jaxdist preset of the same architecture (None: no peer model).
PEER_ARGS = {
    "gpt2-124m": ["--layers", "12", "--d", "768", "--heads", "12", "--seq", "1024"],
    "1b": ["--layers", "16", "--d", "2048", "--heads", "16", "--seq", "2048"],
    # the smoke run's stand-in (the `tiny` preset's shape, GPT-2 vocabulary as the peers have)
    "tiny": ["--layers", "2", "--d", "128", "--heads", "4", "--seq", "128"],
}
RUNS = [("gpt2-124m", 32), ("1b", 8), ("llama-124m", 32), ("llama-1b", 8)]
TARGETS = {"gpt2-124m": 1.10, "1b": 1.08}  # tokens/s over torch.compile's


def run_json(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """The last JSON line the command prints, or {"error": why} (a peer that fails or runs out
    of time must not end the whole comparison)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = {"error": f"timed out after {timeout:.0f} s: {' '.join(cmd)}"}
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        lines = [x for x in text.splitlines() if x.startswith("{")]
        return out | ({"partial": json.loads(lines[-1])} if lines else {})
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode or not lines:
        return {"error": f"exit {r.returncode}: {' '.join(cmd)}", "stderr": r.stderr[-3000:]}
    return json.loads(lines[-1])


def ours_cmd(model: str, batch: int, steps: int, remat: str, extra: tuple = ()) -> list[str]:
    return [
        sys.executable,
        *("-m", "jaxdist.cli", "bench", "--model", model, "--batch-size", str(batch)),
        *("--steps", str(steps), "--remat", remat, *extra),
    ]


def peer_cmd(
    python: str, peers: str, kind: str, model: str, batch: int, steps: int, cpu: bool = False
) -> list:
    """A peer's command; `cpu`: eager PyTorch and XLA's attention, the GPU paths' stand-ins."""
    script = {"torch": "torch_gpt.py", "jax": "jax_gpt.py"}[kind]
    args = [*PEER_ARGS[model], "--batch", str(batch), "--steps", str(steps), "--peak", "989"]
    if cpu:
        args += ["--device", "cpu", "--compile", "0"] if kind == "torch" else ["--attn", "xla"]
    return [python, f"{peers}/{script}", *args]


def mem_gib(r: dict) -> float | None:
    """Peak memory in GiB: jaxdist's bench field, or the peers' `mem_gb` (which is GiB)."""
    return r.get("peak_mem_gib", r.get("mem_gb"))


def ratios(row: dict) -> dict:
    """jaxdist's tokens/s and peak memory over each peer's, where both ran."""
    ours, out = row.get("jaxdist") or {}, {}
    for peer in ("torch", "jax_peer"):
        theirs = row.get(peer) or {}
        if "tokens_per_s" in ours and "tokens_per_s" in theirs:
            out[f"speed_vs_{peer}"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
            # like for like: the peers wait for every step, as this jaxdist figure does
            if "tokens_per_s_synced" in ours:
                synced = ours["tokens_per_s_synced"] / theirs["tokens_per_s"]
                out[f"synced_speed_vs_{peer}"] = synced
            if mem_gib(theirs):
                out[f"memory_vs_{peer}"] = mem_gib(ours) / mem_gib(theirs)
    return out


def print_table(rows: list[dict], file=sys.stdout) -> None:
    print(
        f"{'model':<12}{'remat':<8}{'who':<10}{'tok/s':>12}{'MFU':>8}{'GiB':>7}"
        f"{'vs torch':>10}{'vs jax':>8}",
        file=file,
    )
    for row in rows:
        r = ratios(row)
        for who in ("jaxdist", "torch", "jax_peer"):
            x = row.get(who)
            if not x:
                continue
            if "error" in x:
                print(f"{row['model']:<12}{who:<10} {x['error'][:90]}", file=file)
                continue
            cells = ["", ""]
            if who == "jaxdist":
                cells = [
                    f"{r[k]:.2f}x" if k in r else ""
                    for k in ("speed_vs_torch", "speed_vs_jax_peer")
                ]
            mfu = f"{x['mfu']:.1%}" if x.get("mfu") is not None else "-"
            print(
                f"{row['model']:<12}{row.get('remat', ''):<8}{who:<10}{x['tokens_per_s']:>12,.0f}"
                f"{mfu:>8}{mem_gib(x) or 0:>7.1f}{cells[0]:>10}{cells[1]:>8}",
                file=file,
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default=".peers")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--remat", default="preset", help="jaxdist's --remat (preset: dots)")
    ap.add_argument("--only", nargs="*", help="model names to run (default: all)")
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    import jax

    meta = {
        "date": datetime.date.today().isoformat(),
        "card": jax.devices()[0].device_kind,
        "jax": jax.__version__,
    }
    out = pathlib.Path(__file__).parent / "results" / "gpu_vs_peers.jsonl"
    rows = []
    for model, batch in RUNS:
        if args.only and model not in args.only:
            continue
        cmd = ours_cmd(model, batch, args.steps, args.remat)
        row = {"model": model, "batch": batch, "remat": args.remat}
        row["jaxdist"] = run_json(cmd, args.timeout)
        if model in PEER_ARGS:
            for kind, key in (("torch", "torch"), ("jax", "jax_peer")):
                cmd = peer_cmd(sys.executable, args.peers, kind, model, batch, args.steps)
                row[key] = run_json(cmd, args.timeout)
        rows.append(row | ratios(row))
        with out.open("a") as f:
            f.write(json.dumps({**meta, **rows[-1]}) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
