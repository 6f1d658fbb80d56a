"""Raw text read as bytes (vocabulary 256, no EOS): the embedded default corpus and
`--data FILE|DIR` of text or JSONL that was not tokenized. The whole text is read into memory;
for large data, tokenize it (`jaxdist tokenize`) and the shards are memory-mapped instead."""

import json
import pathlib
import sysconfig

import numpy as np

from jaxdist.errors import ConfigError


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


class ByteWindows:
    """Random access to windows of `length` bytes; neighbours share one byte (targets continue
    inputs)."""

    def __init__(self, tokens: np.ndarray, length: int):
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // (self.length - 1)

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * (self.length - 1)
        return self.tokens[start : start + self.length].astype(np.int32)
