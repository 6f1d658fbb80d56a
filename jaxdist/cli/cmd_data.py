"""`jaxdist tokenize`: text and JSONL into a tokenized data directory for `train --data DIR`."""

import dataclasses
import time
from typing import Annotated

import tyro


@dataclasses.dataclass(frozen=True)
class Tokenize:
    """Tokenize text and JSONL files (.gz too) into token shards with a held-out eval split."""

    input: Annotated[tuple[str, ...], tyro.conf.UseAppendAction]
    """a text or JSONL file, a directory of them, or a glob; repeat --input for more"""
    out: str
    """the data directory to create (it must not exist, or be empty)"""
    tokenizer: str
    """bytes | PATH/tokenizer.json | train:VOCAB_SIZE (a byte-level BPE trained on the input)"""
    eval_fraction: float = 0.01
    """share of documents held out for evaluation, chosen by a hash of each text"""
    workers: int | None = None
    """processes that encode; default: every core (at most one per 2 MB of input)"""
    shard_tokens: int = 2**28
    """tokens per shard file at most (a longer document gets a shard of its own)"""


def tokenize(args: Tokenize) -> int:
    from rich.console import Console

    from jaxdist.data.encode import TokenizeConfig
    from jaxdist.data.encode import tokenize as write

    config = TokenizeConfig(
        inputs=args.input,
        out=args.out,
        tokenizer=args.tokenizer,
        eval_fraction=args.eval_fraction,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
    )
    start = time.perf_counter()
    manifest = write(config, Console(stderr=True))  # progress on stderr, the summary on stdout
    print(summary(manifest, args.out, time.perf_counter() - start))
    return 0


def summary(manifest, out: str, seconds: float) -> str:
    train, held = manifest.splits["train"], manifest.splits["eval"]
    docs = train.num_documents + held.num_documents
    mb = (train.text_bytes + held.text_bytes) / 1e6
    # Without the EOS that opens each document: the tokenizer's own compression.
    per_byte = (train.num_tokens + held.num_tokens - docs) / (mb * 1e6)
    return (
        f"{out}: {docs:,} documents, {mb:.1f} MB of text in {seconds:.1f} s "
        f"({mb / seconds:.1f} MB/s); train {train.num_documents:,} documents "
        f"{train.num_tokens:,} tokens, eval {held.num_documents:,} documents "
        f"{held.num_tokens:,} tokens; {per_byte:.3f} tokens per byte, vocabulary "
        f"{manifest.vocab_size:,} ({manifest.tokenizer})"
    )
