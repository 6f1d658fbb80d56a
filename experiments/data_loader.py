"""The memory-mapped loader: tokens/s per process for gpt2-124m batches, and memory that stays
flat however large the token set.

    python experiments/data_loader.py                       # 2 GB and 20 MB token sets, ~3 min
    python experiments/data_loader.py --large-gb 4 --steps 200

Token sets are written straight in the tokenized format (jaxdist.data.manifest: uint16 shards
of 256 Mi tokens, documents of random lengths opened by EOS, checksums in the manifest) from
random tokens: tokenizing 2 GB of text on 2 cores would take far longer and measure the
tokenizer, not the loader. Then:

1. Loader throughput: `TokenBatches(...).batch(s)` for gpt2-124m batches (32 rows of 1025
   tokens), for one process reading every row and for one of 2 and 8 processes reading its
   share, over random steps of the 2 GB set. The set was just written, so the page cache
   holds most of it (what a second epoch, or a machine with RAM to spare, sees); cold reads
   from disk are bounded by the disk instead. Target: more than 2M tokens/s per process, four
   times what one H200 consumes (the torch.compile peer's 525k tokens/s on gpt2-124m).
2. Memory: the peak RSS of `jaxdist train --data DIR --steps N` (tiny model, 8 fake CPU devices)
   over the large set and over the 20 MB set, same flags; the difference must stay within
   200 MB. Shard checksums are verified at startup by streaming through the page cache, which
   does not count towards the process's RSS, and windows are read with pread (a memory map's
   touched pages would count: jaxdist.data.tokenset).

Prints one JSON line per measurement and writes experiments/results/data_loader.json.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxdist.config import DataConfig
from jaxdist.data import TokenBatches
from jaxdist.data import manifest as mf

SHARD_TOKENS = 1 << 28
VOCAB = 50257  # GPT-2's, so the token dtype is uint16 as for real GPT-2 data


def write_token_set(out: pathlib.Path, num_tokens: int, seed: int) -> None:
    """Random documents (mean 1000 tokens) in the tokenized format, EOS opening each."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    eos, shards, left, index = VOCAB - 1, [], num_tokens, 0
    while left > 0:
        n = min(left, SHARD_TOKENS)
        tokens = rng.integers(0, eos, n, dtype=np.uint16)
        starts = np.cumsum(rng.integers(10, 2000, n // 10 + 1))
        starts = np.concatenate([[0], starts[starts < n]]).astype("<i8")
        tokens[starts] = eos
        names = (f"train-{index:05d}.tokens", f"train-{index:05d}.docs")
        tokens.astype("<u2").tofile(out / names[0])
        starts.tofile(out / names[1])
        digests = {name: mf.sha256_file(out / name) for name in names}
        shards.append(mf.Shard(*names, n, len(starts), digests))
        left, index = left - n, index + 1
    splits = {"train": mf.Split(tuple(shards), num_tokens * 4), "eval": mf.Split()}
    mf.write(out, mf.Manifest("bytes", None, VOCAB, eos, "uint16", splits))


def loader_throughput(data: pathlib.Path, processes: int, steps: int) -> dict:
    B, T = 32, 1024
    rows = range(0, B // processes)
    batches = TokenBatches(DataConfig(path=str(data), batch_size=B), T, 50304, rows)
    rng = np.random.default_rng(0)
    chosen = rng.integers(0, 10**6, steps)
    batches.batch(int(chosen[0]))
    t0 = time.perf_counter()
    for s in chosen:
        batches.batch(int(s))
    dt = time.perf_counter() - t0
    tokens = steps * len(rows) * T
    return {
        "measure": "loader",
        "processes": processes,
        "rows_per_process": len(rows),
        "steps": steps,
        "tokens_per_s_per_process": tokens / dt,
        "vs_h200_gpt2_consumption": tokens / dt / 525_341,
    }


def train_peak_rss(data: pathlib.Path, steps: int, run_dir: pathlib.Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.cli",
        "train",
        "--data",
        str(data),
        "--steps",
        str(steps),
        "--batch-size",
        "16",
        "--devices",
        "cpu:8",
        "--run-dir",
        str(run_dir),
        "--checkpoint-every",
        "1000000",
        "--eval-every",
        "0",
        "--compile-cache",
        "off",
    ]
    # getrusage of the children: the peak resident set of the training process itself.
    code = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
    )
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", code, *cmd], capture_output=True, text=True, check=False
    )
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    size = sum(f.stat().st_size for f in data.glob("*.tokens"))
    return {
        "measure": "train_peak_rss",
        "token_set_bytes": size,
        "steps": steps,
        "peak_rss_mb": int(p.stdout.strip().splitlines()[-1]) / 1024,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large-gb", type=float, default=2.0)
    parser.add_argument("--small-mb", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=100, help="training steps per RSS run")
    parser.add_argument("--loader-steps", type=int, default=300)
    parser.add_argument("--out", default="experiments/results")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        tmp = pathlib.Path(tmp)
        large, small = tmp / "large", tmp / "small"
        write_token_set(large, int(args.large_gb * 1e9 / 2), 0)
        write_token_set(small, int(args.small_mb * 1e6 / 2), 1)
        for procs in (1, 2, 8):
            results.append(loader_throughput(large, procs, args.loader_steps))
            print(json.dumps(results[-1]), flush=True)
        rss = {}
        for name, data in (("small", small), ("large", large)):
            rss[name] = train_peak_rss(data, args.steps, tmp / f"run-{name}")
            results.append(rss[name])
            print(json.dumps(rss[name]), flush=True)
        diff = rss["large"]["peak_rss_mb"] - rss["small"]["peak_rss_mb"]
        results.append({"measure": "rss_difference_mb", "value": diff, "limit": 200})
        print(json.dumps(results[-1]))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_loader.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
