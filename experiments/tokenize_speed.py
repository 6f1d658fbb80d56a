"""How fast does `jaxdist tokenize` turn text into shards? MB of text per second, per tokenizer
and worker count.

    python experiments/tokenize_speed.py                  # 64 MB; bytes and a BPE of 8192
    python experiments/tokenize_speed.py --mb 16 --workers 1,4 --out speed.jsonl

The corpus is this interpreter's standard-library sources (present on every machine), one JSONL
document per .py file, repeated until it holds --mb MB. A byte-level BPE of --vocab tokens is
trained once on its first --train-mb MB (timed, one line), then jaxdist.data.encode.tokenize
writes the whole corpus with the byte tokenizer and with that BPE, for each --workers count
(default: 1 and every core). Each configuration prints one JSON line; its seconds are the whole
call: reading, encoding, writing and checksumming the shards, and starting the worker processes
(spawned: each imports the tokenizer and numpy, about 0.3 s).
"""

import argparse
import json
import os
import pathlib
import shutil
import sysconfig
import tempfile
import time


def corpus(directory: pathlib.Path, mb: float) -> tuple[list[pathlib.Path], list[str]]:
    """JSONL files of about 8 MB holding `mb` MB of text, and the distinct documents."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    docs = [p.read_text(encoding="utf-8", errors="replace") for p in sources]
    docs = [d for d in docs if d]
    files, written, lines = [], 0, []
    while written < mb * 1e6:
        for doc in docs:
            lines.append(json.dumps({"text": doc}))
            written += len(doc.encode("utf-8"))
            if sum(map(len, lines)) > 8e6 or written >= mb * 1e6:
                files.append(directory / f"part-{len(files):03d}.jsonl")
                files[-1].write_text("\n".join(lines) + "\n")
                lines = []
            if written >= mb * 1e6:
                break
    return files, docs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=64, help="MB of text to tokenize")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--train-mb", type=float, default=8, help="MB of text the BPE learns from")
    ap.add_argument("--workers", default=None, help="comma-separated (default: 1 and all cores)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args()

    from rich.console import Console

    from jaxdist.data import tokenizer as tk
    from jaxdist.data.encode import TokenizeConfig, tokenize

    cores = len(os.sched_getaffinity(0))
    counts = sorted({int(w) for w in args.workers.split(",")} if args.workers else {1, cores})
    work = pathlib.Path(tempfile.mkdtemp(prefix="jaxdist-tokspeed-", dir=args.dir))
    records = []
    try:
        files, docs = corpus(work, args.mb)
        sample, size = [], 0
        for doc in docs:
            sample.append(doc)
            size += len(doc.encode("utf-8"))
            if size >= args.train_mb * 1e6:
                break
        t0 = time.perf_counter()
        bpe = tk.train(sample, args.vocab)
        train_s = time.perf_counter() - t0
        records.append(
            {"train": f"bpe-{args.vocab}", "mb": round(size / 1e6, 1), "seconds": round(train_s, 2)}
        )
        print(json.dumps(records[-1]), flush=True)
        bpe.save(work)
        tokenizers = {"bytes": "bytes", f"bpe-{args.vocab}": str(work / "tokenizer.json")}
        for name, spec in tokenizers.items():
            for workers in counts:
                out = work / f"out-{name}-{workers}"
                config = TokenizeConfig(tuple(map(str, files)), str(out), spec, 0.01, workers)
                t0 = time.perf_counter()
                manifest = tokenize(config, Console(quiet=True))
                seconds = time.perf_counter() - t0
                splits = manifest.splits.values()
                text = sum(s.text_bytes for s in splits)
                tokens = sum(s.num_tokens - s.num_documents for s in splits)  # EOS left out
                records.append(
                    {
                        "tokenizer": name,
                        "workers": workers,
                        "cores": cores,
                        "mb": round(text / 1e6, 1),
                        "seconds": round(seconds, 2),
                        "mb_per_s": round(text / 1e6 / seconds, 2),
                        "tokens_per_byte": round(tokens / text, 3),
                    }
                )
                print(json.dumps(records[-1]), flush=True)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
