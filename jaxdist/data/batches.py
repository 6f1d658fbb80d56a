"""Deterministic, resumable token batches: the batch of global step s is a function of (seed, s).

A source is cut into windows of seq_len + 1 tokens (neighbours share one: targets continue
inputs); grain shuffles each source's windows (a fresh permutation each epoch) with random
access, so global row g = s * batch_size + r reads window g of its source's shuffled stream, and
a process reads only its own rows. A resume, on any mesh or process count, continues the same
stream. Sources: raw text as bytes (jaxdist.data.corpus), a tokenized directory memory-mapped
(jaxdist.data.tokenset), or a weighted mixture of tokenized directories (jaxdist.data.mixture).
"""

import copy
import hashlib
import pathlib
from typing import NamedTuple

import grain
import numpy as np

from jaxdist.config import DataConfig
from jaxdist.data import corpus, mixture
from jaxdist.data.manifest import is_token_dir
from jaxdist.data.tokenset import TokenSet, TokenWindows
from jaxdist.errors import ConfigError

BYTE_VOCAB = 256


class Source(NamedTuple):
    name: str
    weight: float
    windows: grain.MapDataset  # shuffled, repeated: index g -> int32 window
    num_windows: int


_VERIFIED: set[tuple[str, float]] = set()


def open_tokenset(path: str) -> TokenSet:
    """A tokenized directory, its checksums verified once per process."""
    manifest_file = pathlib.Path(path) / "manifest.json"
    key = (str(pathlib.Path(path).resolve()), manifest_file.stat().st_mtime)
    tokens = TokenSet(path, verify=key not in _VERIFIED)
    _VERIFIED.add(key)
    return tokens


class TokenBatches:
    """Batches of shape [len(rows), seq_len + 1] (int32): the given rows of each global batch.

    A process asks only for the rows its devices hold (jaxdist.cluster.join.process_rows).
    `split` is "train" or "eval" (the held-out documents of a tokenized directory).
    """

    def __init__(
        self,
        config: DataConfig,
        seq_len: int,
        vocab_size: int,
        rows: range | None = None,
        split: str = "train",
    ):
        config.validate()
        self.config, self.split = config, split
        self.rows = self._check_rows(range(config.batch_size) if rows is None else rows)
        self.global_shape = (config.batch_size, seq_len + 1)
        length = seq_len + 1
        path = config.path
        if path is not None and mixture.is_mixture(path):
            parts = mixture.parse(path)
            sets = [(c.name, c.weight, self._token_dir(c.path, c.name)) for c in parts]
        elif path is not None and is_token_dir(path):
            sets = [("data", 1.0, open_tokenset(path))]
        else:
            sets = []
        if sets:
            first = sets[0][2]
            for name, _, t in sets[1:]:
                if t.manifest.tokenizer_sha256 != first.manifest.tokenizer_sha256 or (
                    t.eos_id,
                    t.vocab_size,
                ) != (first.eos_id, first.vocab_size):
                    raise ConfigError(
                        f"mixture source {name!r} ({t.directory}) was tokenized with another "
                        f"tokenizer than {sets[0][0]!r} ({first.directory}); tokenize every "
                        "source with the same --tokenizer"
                    )
            self.vocab_size, self.eos_id = first.vocab_size, first.eos_id
            self.tokenizer = first.manifest.tokenizer
            self.tokens_per_byte = first.tokens_per_byte(split)
            self.fingerprint = ",".join(f"{n}:{t.manifest.fingerprint()}" for n, _, t in sets)
            raw = []
            for name, weight, t in sets:
                if not t.split(split).num_tokens:
                    raise ConfigError(
                        f"{t.directory} has no {split} split (tokenized with --eval-fraction "
                        f"0?); pass --eval-data DATA_DIR or tokenize with --eval-fraction > 0"
                        if split == "eval"
                        else f"{t.directory} holds no training tokens; tokenize more text"
                    )
                raw.append((name, weight, TokenWindows(t.stream(split), length)))
        else:
            if split != "train":
                raise ConfigError(
                    "text read as bytes has no eval split; pass --eval-data DATA_DIR, or "
                    "tokenize the text (jaxdist tokenize --eval-fraction 0.01) and train on that"
                )
            text = corpus.load_corpus(path)
            self.vocab_size, self.eos_id, self.tokenizer = BYTE_VOCAB, None, "raw-bytes"
            self.tokens_per_byte = 1.0
            # The text's own hash: the same text under another path is the same stream.
            self.fingerprint = f"raw-bytes:{hashlib.sha256(text).hexdigest()[:16]}"
            data = np.frombuffer(text, np.uint8)
            raw = [("data", 1.0, corpus.ByteWindows(data, length))]
        if vocab_size < self.vocab_size:
            raise ConfigError(
                f"the data's vocabulary has {self.vocab_size} tokens, the model's "
                f"{vocab_size}; use a model with a vocabulary of at least {self.vocab_size}"
            )
        for name, _, windows in raw:
            if len(windows) < 1:
                raise ConfigError(
                    f"data {name!r} ({split}) has fewer than one sequence of {length} "
                    "tokens; pass more text or a model with a shorter sequence"
                )
        self.sources = [
            Source(n, w, grain.MapDataset.source(win).shuffle(seed=config.seed).repeat(), len(win))
            for n, w, win in raw
        ]
        self.draw = mixture.Draw([s.weight for s in self.sources], config.seed, config.batch_size)
        self.num_windows = sum(s.num_windows for s in self.sources)

    @staticmethod
    def _token_dir(path: str, name: str) -> TokenSet:
        if not is_token_dir(path):
            raise ConfigError(
                f"mixture source {name!r}: {path} is not a tokenized directory (no "
                "manifest.json); mix only tokenized data: jaxdist tokenize --out DIR ..."
            )
        return open_tokenset(path)

    def _check_rows(self, rows: range) -> range:
        if rows.start < 0 or rows.stop > self.config.batch_size or not len(rows):
            raise ConfigError(f"rows {rows} do not lie within a batch of {self.config.batch_size}")
        return rows

    def for_rows(self, rows: range) -> "TokenBatches":
        """The same stream, reading only these rows of each global batch (one process's)."""
        out = copy.copy(self)
        out.rows = self._check_rows(rows)
        return out

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def batch(self, step: int) -> np.ndarray:
        base = step * self.config.batch_size
        which = self.draw.sources(step)
        return np.stack([self.sources[which[r]].windows[base + r] for r in self.rows])


def data_vocab(path: str | None) -> tuple[int, int | None]:
    """(vocabulary size, EOS id) of the data at `path`, from its manifest alone (no shard is
    read): what the model's vocabulary must cover before anything is built."""
    if path is not None and mixture.is_mixture(path):
        path = mixture.parse(path)[0].path
    if path is not None and is_token_dir(path):
        from jaxdist.data.manifest import read

        m = read(path)
        return m.vocab_size, m.eos_id
    return BYTE_VOCAB, None
