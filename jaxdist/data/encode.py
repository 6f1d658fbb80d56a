"""`jaxdist tokenize`: text and JSONL files into a tokenized data directory (jaxdist.data.manifest).

Documents, in a fixed order: the inputs as given, each expanded (a directory: every file under
it, sorted; a glob: its sorted matches; a file: itself), a file named twice read once. A
`.jsonl` or `.jsonl.gz` file holds one document per line (`{"text": ...}`; blank lines skipped);
any other file, gzipped or not, is one document. Empty texts are skipped.

The main process reads the files and writes the shards; a pool of `workers` processes (spawned:
the CLI may have imported jax, which does not survive a fork) parses, hashes and encodes chunks
of documents, returned in order, so the bytes written do not depend on the number of workers.
A document goes to the eval split when a hash of its text falls below `eval_fraction`, so the
split of a document never moves when others are added (and duplicates land together).

The directory is built beside `out` under a hidden temporary name and renamed at the end: an
error leaves nothing behind, and even a killed process never leaves a half-made `out`.
"""

import collections
import contextlib
import dataclasses
import glob
import gzip
import hashlib
import json
import multiprocessing
import os
import pathlib
import secrets
import shutil
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

import numpy as np

from jaxdist.data import manifest as mf
from jaxdist.data import tokenizer as tk
from jaxdist.errors import ConfigError

CHUNK_BYTES = 1 << 21  # per task: small enough to balance the workers, large to amortize IPC


@dataclasses.dataclass(frozen=True)
class TokenizeConfig:
    inputs: tuple[str, ...]  # files, directories or globs
    out: str  # the data directory to create
    tokenizer: str = tk.BYTES  # bytes | train:VOCAB_SIZE | PATH to a tokenizer.json
    eval_fraction: float = 0.01
    workers: int | None = None  # None: every core this process may run on
    shard_tokens: int = 2**28  # a shard closes before the document that would pass this

    def validate(self) -> None:
        if not self.inputs:
            raise ConfigError("no --input given; pass a text or JSONL file, directory or glob")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(
                f"--eval-fraction {self.eval_fraction} is outside [0, 1); pass e.g. 0.01 (1% of "
                "documents held out for evaluation) or 0 for no eval split"
            )
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers {self.workers}: pass 1 or more (default: every core)")
        if self.shard_tokens < 1:
            raise ConfigError(f"--shard-tokens {self.shard_tokens}: pass a positive count")
        tk.parse_spec(self.tokenizer)


def input_files(inputs: tuple[str, ...]) -> list[pathlib.Path]:
    files: dict[str, pathlib.Path] = {}  # by real path, first mention kept
    for given in inputs:
        path = pathlib.Path(given)
        if path.exists():
            matches = [path]
        elif any(c in given for c in "*?["):
            matches = [pathlib.Path(m) for m in sorted(glob.glob(given, recursive=True))]
        else:
            raise ConfigError(f"--input {given} does not exist; check the path")
        found = []
        for m in matches:
            found += sorted(f for f in m.rglob("*") if f.is_file()) if m.is_dir() else [m]
        if not found:
            raise ConfigError(f"--input {given} matched no files; check the path or pattern")
        for f in found:
            files.setdefault(os.path.realpath(f), f)
    return list(files.values())


def _read(files: list[pathlib.Path]) -> Iterator[tuple[str, int, bytes]]:
    """(file, line, raw bytes) per document: line 0 is a whole text file."""
    for f in files:
        opener = gzip.open if f.name.endswith(".gz") else open
        try:
            with opener(f, "rb") as stream:
                if not f.name.endswith((".jsonl", ".jsonl.gz")):
                    yield str(f), 0, stream.read()
                    continue
                for n, line in enumerate(stream, 1):
                    if line.strip():
                        yield str(f), n, line
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise ConfigError(
                f"cannot read {f} ({e}); repair or re-fetch it, or leave it out of --input"
            ) from None


def _text(source: str, line: int, raw: bytes) -> tuple[str, bytes]:
    """A document's text and its UTF-8 bytes."""
    if line == 0:
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{source} is not UTF-8 text (byte {e.start}); convert it (iconv -t UTF-8) or "
                "leave it out of --input"
            ) from None
    try:
        text = json.loads(raw)["text"]
        if not isinstance(text, str):
            raise TypeError
        return text, text.encode("utf-8")
    except (ValueError, KeyError, TypeError, IndexError):  # ValueError: JSON, UTF-8
        raise ConfigError(
            f"{source}:{line} is not a JSON object with a string 'text' field; fix or remove "
            "the line"
        ) from None


def in_eval(data: bytes, eval_fraction: float) -> bool:
    """The document's hash, read as a number in [0, 1), is below the fraction."""
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < eval_fraction


class _Part(NamedTuple):
    tokens: np.ndarray  # EOS, then the document's ids, for each document
    lengths: np.ndarray  # int64 tokens per document, its EOS included
    text_bytes: int


def _encode(chunk, tokenizer: tk.Tokenizer, eval_fraction: float):
    """The chunk's documents per split, and the input bytes they came from."""
    by_split: dict[str, list] = {name: [] for name in mf.SPLITS}
    for source, line, raw in chunk:
        text, data = _text(source, line, raw)
        if text:
            by_split["eval" if in_eval(data, eval_fraction) else "train"].append(
                (source, line, text, len(data))
            )
    eos = np.array([tokenizer.eos_id], tokenizer.dtype)
    parts = {}
    for name, docs in by_split.items():
        ids = tokenizer.encode_batch([d[2] for d in docs])
        tokens = np.concatenate([x for a in ids for x in (eos, a)] or [eos[:0]])
        lengths = np.array([len(a) + 1 for a in ids], np.int64)
        if np.count_nonzero(tokens == tokenizer.eos_id) != len(docs):
            source, line, _, _ = next(d for d, a in zip(docs, ids, strict=True) if eos[0] in a)
            where = f"{source}:{line}" if line else source
            raise ConfigError(
                f"{where}: the tokenizer encodes this text to its EOS id {tokenizer.eos_id}, "
                "which must only separate documents; remove that text or use another --tokenizer"
            )
        parts[name] = _Part(tokens, lengths, sum(d[3] for d in docs))
    return parts, sum(len(raw) for _, _, raw in chunk)


_WORKER: tuple[tk.Tokenizer, float] | None = None


def _init_worker(json_text: str | None, eos_id: int | None, eval_fraction: float) -> None:
    global _WORKER
    # One core per worker: the pool is the parallelism, not the library's thread pool.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # The EOS the parent found (the model's files may declare one no name guess finds).
    _WORKER = (tk.Tokenizer(json_text, eos_id=eos_id), eval_fraction)


def _encode_in_worker(chunk):
    return _encode(chunk, *_WORKER)


@contextlib.contextmanager
def _single_threaded():
    # `tokenizers` reads this at every batch call: --workers 1 then means one core here too.
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM")
        if before is not None:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _chunks(items: Iterator[tuple[str, int, bytes]]) -> Iterator[list]:
    chunk, size = [], 0
    for item in items:
        chunk.append(item)
        size += len(item[2])
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encoded(files, tokenizer: tk.Tokenizer, config: TokenizeConfig, workers: int):
    """(parts, raw bytes read) per chunk, in input order."""
    chunks = _chunks(_read(files))
    if workers == 1:
        with _single_threaded():
            for chunk in chunks:
                yield _encode(chunk, tokenizer, config.eval_fraction)
        return
    # An executor, not multiprocessing.Pool: a worker that dies raises here instead of being
    # restarted forever, and a bounded queue of futures keeps the input from being read ahead.
    with ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(tokenizer.json_text, tokenizer.eos_id, config.eval_fraction),
    ) as pool:
        pending = collections.deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(_encode_in_worker, chunk))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def tokenize(config: TokenizeConfig, console) -> mf.Manifest:
    """Writes the data directory `config.out` and returns its manifest; progress goes to
    `console` (a rich Console)."""
    config.validate()
    spec = tk.parse_spec(config.tokenizer)
    files = input_files(config.inputs)
    out = pathlib.Path(config.out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConfigError(
            f"--out {out} already exists and is not an empty directory; pass a new --out or "
            "remove it first"
        )
    # Compressed sizes say little of what they hold: no total (no bar) with .gz inputs.
    gz = any(f.name.endswith(".gz") for f in files)
    size = sum(f.stat().st_size for f in files)
    workers = _workers(config.workers, 4 * size if gz else size)
    with _progress(console) as progress:
        total = None if gz else size
        tokenizer = _tokenizer(spec, files, progress, total)
        out.parent.mkdir(parents=True, exist_ok=True)
        # Beside `out`, so the final rename stays on one filesystem.
        tmp = out.parent / f".{out.name}.{secrets.token_hex(4)}.partial"
        tmp.mkdir()
        try:
            meter = _Meter(progress, total, "tokenizing")
            manifest = _write(tmp, files, tokenizer, config, workers, meter)
            if out.exists():
                out.rmdir()
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if config.eval_fraction and not manifest.splits["eval"].num_documents:
        console.print(f"note: no document fell in the eval split of {out}", highlight=False)
    return manifest


def _workers(asked: int | None, input_bytes: int) -> int:
    """As asked (default: the cores this process may run on), but no more than there are
    chunks: each worker costs a process start and its imports."""
    if asked is None:
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
        asked = len(cores) or os.cpu_count() or 1
    return max(1, min(asked, -(-input_bytes // CHUNK_BYTES)))


def _progress(console):
    from rich import progress as rp

    return rp.Progress(
        rp.TextColumn("{task.description}"),
        rp.BarColumn(),
        rp.TaskProgressColumn(),
        rp.TextColumn("{task.fields[docs]:,} documents, {task.fields[mb]:.1f} MB text"),
        rp.TextColumn("{task.fields[rate]:.1f} MB/s"),
        rp.TimeElapsedColumn(),
        rp.TimeRemainingColumn(),
        console=console,
    )


class _Meter:
    """One pass's progress: input bytes read (of `total`), documents, MB of text, MB/s."""

    def __init__(self, progress, total: int | None, description: str):
        self.progress, self.shown, self.t0 = progress, 0.0, time.perf_counter()
        self.task = progress.add_task(description, total=total, docs=0, mb=0.0, rate=0.0)
        self.raw = self.docs = self.text_bytes = 0

    def add(self, raw: int, docs: int, text_bytes: int, last: bool = False) -> None:
        self.raw, self.docs = self.raw + raw, self.docs + docs
        self.text_bytes += text_bytes
        now = time.perf_counter()
        if last or now - self.shown >= 0.1:
            self.shown, mb = now, self.text_bytes / 1e6
            rate = mb / max(now - self.t0, 1e-9)
            self.progress.update(self.task, completed=self.raw, docs=self.docs, mb=mb, rate=rate)
        if last:
            self.progress.stop_task(self.task)


def _tokenizer(spec: tk.TokenizerSpec, files, progress, total) -> tk.Tokenizer:
    if spec.path is not None:
        return tk.load(spec.path)
    if spec.train_vocab is None:
        return tk.Tokenizer()
    meter = _Meter(progress, total, f"training BPE ({spec.train_vocab:,})")

    def texts():
        for source, line, raw in _read(files):
            text, data = _text(source, line, raw)
            meter.add(len(raw), bool(text), len(data) if text else 0)
            if text:
                yield text

    tokenizer = tk.train(texts(), spec.train_vocab)
    meter.add(0, 0, 0, last=True)
    if meter.docs == 0:
        raise ConfigError(_empty(files))
    return tokenizer


def _empty(files) -> str:
    return (
        f"the {len(files)} input file(s) ({files[0]}, ...) hold no text; pass files with text "
        "in them (a JSONL file needs a 'text' field per line)"
    )


def _write(tmp, files, tokenizer, config, workers, meter: _Meter) -> mf.Manifest:
    dtype = mf.token_dtype(tokenizer.vocab_size)
    writers = {name: mf.ShardWriter(tmp, name, dtype, config.shard_tokens) for name in mf.SPLITS}
    for parts, raw in _encoded(files, tokenizer, config, workers):
        for name, part in parts.items():
            writers[name].add(part.tokens, part.lengths, part.text_bytes)
        parts = parts.values()
        meter.add(raw, sum(len(p.lengths) for p in parts), sum(p.text_bytes for p in parts))
    meter.add(0, 0, 0, last=True)
    splits = {name: w.finish() for name, w in writers.items()}
    if not sum(s.num_documents for s in splits.values()):
        raise ConfigError(_empty(files))
    if not splits["train"].num_documents:
        raise ConfigError(
            f"all {splits['eval'].num_documents} documents fell in the eval split; lower "
            "--eval-fraction or add documents"
        )
    tokenizer.save(tmp)
    manifest = mf.Manifest(
        tokenizer=tokenizer.name,
        tokenizer_sha256=tokenizer.sha256,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        dtype=dtype,
        splits=splits,
        eval_fraction=config.eval_fraction,
    )
    mf.write(tmp, manifest)
    return manifest
