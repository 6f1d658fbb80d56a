"""Deterministic, resumable token batches: the batch of global step s is a function of (seed, s).

A corpus is one byte string cut into windows of seq_len + 1 tokens; grain shuffles the windows
(a fresh permutation each epoch) with random access, so row r of step s is window number
s * batch_size + r of the shuffled stream, and a process reads only its own rows. A resume, on
any mesh or process count, continues the same stream.
"""

import dataclasses
import json
import pathlib
import sysconfig

import grain
import numpy as np

from jaxdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str | None = None  # None: the embedded default corpus (Python's standard library)
    batch_size: int = 16
    seed: int = 0


def default_corpus() -> bytes:
    """The running interpreter's standard library sources: present on every machine."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise ConfigError(f"no standard library sources found under {root}; pass --data FILE")
    return b"\n".join(p.read_bytes() for p in files)


def load_corpus(path: str | None) -> bytes:
    if path is None:
        return default_corpus()
    p = pathlib.Path(path)
    if not p.exists():
        raise ConfigError(f"data file {path} does not exist; pass an existing .txt or .jsonl")
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    parts: list[bytes] = []
    for f in files:
        if f.suffix == ".jsonl":
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    parts.append(json.loads(line)["text"].encode("utf-8"))
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                    raise ConfigError(
                        f"{f}:{n} is not a JSON object with a string 'text' field; fix or "
                        "remove the line"
                    ) from None
        else:
            parts.append(f.read_bytes())
    corpus = b"\n".join(parts)
    if not corpus:
        raise ConfigError(f"data at {path} is empty; pass a file with text in it")
    return corpus


class _Windows:
    """Random access to non-overlapping windows of `length` bytes."""

    def __init__(self, tokens: np.ndarray, length: int):
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // (self.length - 1)

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * (self.length - 1)  # windows share one token: targets continue inputs
        return self.tokens[start : start + self.length]


class TokenBatches:
    """Batches of shape [len(rows), seq_len + 1] (int32): the given rows of each global batch.

    A process asks only for the rows its devices hold (jaxdist.cluster.join.process_rows).
    """

    def __init__(
        self, config: DataConfig, seq_len: int, vocab_size: int, rows: range | None = None
    ):
        rows = range(config.batch_size) if rows is None else rows
        if rows.start < 0 or rows.stop > config.batch_size or not len(rows):
            raise ConfigError(f"rows {rows} do not lie within a batch of {config.batch_size}")
        if vocab_size < 256:
            raise ConfigError(f"byte-level data needs vocab >= 256, model has {vocab_size}")
        corpus = np.frombuffer(load_corpus(config.path), dtype=np.uint8)
        windows = _Windows(corpus.astype(np.int32), seq_len + 1)
        if len(windows) < 1:
            raise ConfigError(
                f"data has {len(corpus)} bytes, fewer than one sequence of {seq_len + 1}; "
                "pass more text or a model with a shorter sequence"
            )
        self.config = config
        self.global_shape = (config.batch_size, seq_len + 1)
        self.num_windows = len(windows)
        self.rows = rows
        self._dataset = grain.MapDataset.source(windows).shuffle(seed=config.seed).repeat()

    def batch(self, step: int) -> np.ndarray:
        base = step * self.config.batch_size
        return np.stack([self._dataset[base + r] for r in self.rows])
