"""A tokenized data directory: flat token shards, document boundaries and their manifest.

    DATA_DIR/
      manifest.json          what follows, and a checksum per file
      tokenizer.json         the tokenizer (absent for the built-in byte tokenizer)
      train-00000.tokens     flat little-endian uint16 (vocabulary <= 65536) or uint32 tokens
      train-00000.docs       little-endian int64: each document's first token, shard-relative
      eval-00000.tokens ...  whole documents held out by a hash of their text

Each document is stored as EOS followed by its tokens, so the concatenated shards of a split
are the documents with EOS between them, and EOS opens every document: a packed row finds its
document boundaries (and the positions within each document) from its tokens alone.

Written by jaxdist.data.encode (`jaxdist tokenize`), read by jaxdist.data.tokenset.
"""

import dataclasses
import hashlib
import json
import pathlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxdist.errors import ConfigError

FORMAT = "jaxdist.tokens/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Shard:
    tokens_file: str
    docs_file: str
    num_tokens: int
    num_documents: int
    sha256: dict[str, str]  # file name -> hex digest


@dataclasses.dataclass(frozen=True)
class Split:
    shards: tuple[Shard, ...] = ()
    text_bytes: int = 0  # UTF-8 bytes of the documents' text: for bits per byte

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)


@dataclasses.dataclass(frozen=True)
class Manifest:
    tokenizer: str  # "bytes", or the tokenizer.json beside the shards
    tokenizer_sha256: str | None  # of tokenizer.json; None for bytes
    vocab_size: int
    eos_id: int
    dtype: str  # "uint16" | "uint32"
    splits: dict[str, Split]
    eval_fraction: float = 0.0
    format: str = FORMAT

    def fingerprint(self) -> str:
        """Names this data exactly (tokenizer and every shard's checksum): a resume checks it."""
        h = hashlib.sha256(str(self.tokenizer_sha256).encode())
        for name in SPLITS:
            for shard in self.splits.get(name, Split()).shards:
                for digest in sorted(shard.sha256.values()):
                    h.update(digest.encode())
        return h.hexdigest()[:16]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sha256_file(path: pathlib.Path, chunk: int = 1 << 24) -> str:
    # Read in chunks (page cache, not resident memory): verifying never holds a shard in RSS.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write(directory: pathlib.Path, manifest: Manifest) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2))


def is_token_dir(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path) / MANIFEST).is_file()


def read(directory: str | pathlib.Path) -> Manifest:
    """The manifest, checked for shape (not yet against the shards: see `verify`)."""
    directory = pathlib.Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ConfigError(
            f"{directory} has no {MANIFEST}; make it with `jaxdist tokenize --input TEXT "
            f"--out {directory} --tokenizer ...`"
        )
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
        splits = {
            name: Split(tuple(Shard(**s) for s in split["shards"]), int(split.get("text_bytes", 0)))
            for name, split in raw.pop("splits").items()
        }
        manifest = Manifest(**raw, splits=splits)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"{path} is not a jaxdist token manifest ({e}); tokenize the data again"
        ) from None
    if manifest.dtype not in ("uint16", "uint32"):
        raise ConfigError(f"{path}: token dtype {manifest.dtype!r} is not uint16 or uint32")
    return manifest


def verify(directory: str | pathlib.Path, manifest: Manifest) -> None:
    """Every shard present, of its recorded size and checksum: a truncated or altered shard
    ends here, before anything is compiled, naming the file."""
    directory = pathlib.Path(directory)
    itemsize = np.dtype(manifest.dtype).itemsize
    expected: list[tuple[pathlib.Path, int, str]] = []
    for split in manifest.splits.values():
        for shard in split.shards:
            for name, size in (
                (shard.tokens_file, shard.num_tokens * itemsize),
                (shard.docs_file, shard.num_documents * 8),
            ):
                expected.append((directory / name, size, shard.sha256[name]))
    fix = "tokenize the data again (jaxdist tokenize) or restore the file from its source"
    for path, size, _ in expected:
        if not path.is_file():
            raise ConfigError(f"shard {path} is missing; {fix}")
        if path.stat().st_size != size:
            raise ConfigError(
                f"shard {path} holds {path.stat().st_size} bytes, the manifest says {size} "
                f"(truncated or altered); {fix}"
            )
    # hashlib releases the GIL on large blocks: shards hash in parallel.
    with ThreadPoolExecutor(max_workers=8) as pool:
        digests = list(pool.map(lambda e: sha256_file(e[0]), expected))
    for (path, _, want), got in zip(expected, digests, strict=True):
        if got != want:
            raise ConfigError(f"shard {path} fails its checksum (altered or corrupt); {fix}")


class ShardWriter:
    """One split's shards, checksummed as they are written; files open at the first document."""

    def __init__(self, directory: pathlib.Path, split: str, dtype: str, limit: int):
        self.directory, self.split, self.limit = directory, split, limit
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shards: list[Shard] = []
        self.files = None  # [(name, file, sha256)] of the open shard: tokens, then docs
        self.num_tokens = self.num_docs = self.text_bytes = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: int) -> None:
        """Documents in order: their tokens end to end (each opened by EOS), their lengths."""
        self.text_bytes += text_bytes
        start = offset = 0  # document, token
        while start < len(lengths):
            ends = np.cumsum(lengths[start:])
            fit = int(np.searchsorted(ends, self.limit - self.num_tokens, side="right"))
            if fit == 0 and self.num_tokens:
                self._close()
                continue
            fit = max(fit, 1)  # a document longer than a shard gets a shard of its own
            if self.files is None:
                self._open()
            size = int(ends[fit - 1])
            firsts = self.num_tokens + np.concatenate([[0], ends[: fit - 1]])
            self._append(0, tokens[offset : offset + size].astype(self.dtype, copy=False))
            self._append(1, firsts.astype("<i8"))
            self.num_tokens += size
            self.num_docs += fit
            start, offset = start + fit, offset + size

    def finish(self) -> Split:
        if self.files is not None:
            self._close()
        return Split(tuple(self.shards), self.text_bytes)

    def _open(self) -> None:
        stem = f"{self.split}-{len(self.shards):05d}"
        names = (f"{stem}.tokens", f"{stem}.docs")
        self.files = [(n, open(self.directory / n, "wb"), hashlib.sha256()) for n in names]

    def _append(self, which: int, array: np.ndarray) -> None:
        _, f, h = self.files[which]
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        f.write(data)
        h.update(data)

    def _close(self) -> None:
        for _, f, _ in self.files:
            f.close()
        (tokens_file, _, th), (docs_file, _, dh) = self.files
        digests = {tokens_file: th.hexdigest(), docs_file: dh.hexdigest()}
        shard = Shard(tokens_file, docs_file, self.num_tokens, self.num_docs, digests)
        self.shards.append(shard)
        self.files, self.num_tokens, self.num_docs = None, 0, 0
