"""Raw text read as bytes (vocabulary 256, no EOS): the embedded default corpus and
`--data FILE|DIR` of text or JSONL that was not tokenized (a directory: every file in it but
hidden ones; compressed files and stray token shards are refused, naming `jaxdist tokenize`).
The whole text is read into memory; for large data, tokenize it (`jaxdist tokenize`) and the
shards are memory-mapped instead."""

import json
import os
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


# What --data takes, for every message that refuses one.
ACCEPTS = (
    "--data takes a tokenized directory (made by: jaxdist tokenize --input DIR --out DATA "
    "--tokenizer train:8192), a mixture NAME=DATA:WEIGHT,..., or a .txt/.jsonl file or a "
    "directory of them, read as bytes"
)
# Files whose bytes are an encoding, not text: read raw, a model would learn the encoding.
_ENCODED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".parquet", ".arrow", ".npy")
# A tokenized directory's shards (jaxdist.data.manifest), which need its manifest.json.
_SHARDS = (".tokens", ".docs")


def load_corpus(path: str | None) -> bytes:
    if path is None:
        return default_corpus()
    files = _text_files(path)
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


def _text_files(path: str) -> list[pathlib.Path]:
    """The files --data PATH reads as bytes (a directory's, hidden ones left out), or a
    ConfigError saying what is there and what --data takes."""
    p = pathlib.Path(path)
    if not p.exists():
        what = "directory" if path.endswith(("/", os.sep)) else "file or directory"
        raise ConfigError(
            f"--data {path} does not exist (no {what} there, looked from "
            f"{pathlib.Path.cwd()}); {ACCEPTS}"
        )
    if not p.is_dir():
        files = [p]
    else:
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if not files:
            raise ConfigError(f"--data {path} is a directory with no files in it; {ACCEPTS}")
        if any(f.suffix in _SHARDS for f in files):
            raise ConfigError(
                f"--data {path} holds token shards but no manifest.json (an unfinished "
                "jaxdist tokenize?); tokenize again: jaxdist tokenize --input DIR --out "
                f"{path} --tokenizer ..."
            )
    encoded = [f for f in files if f.suffix in _ENCODED]
    if encoded:
        found = encoded[0].name + (f" and {len(encoded) - 1} more" if len(encoded) > 1 else "")
        raise ConfigError(
            f"--data {path}: {found} is compressed or binary, not text to read as bytes; "
            f"tokenize it (jaxdist tokenize reads .gz): jaxdist tokenize --input {path} --out "
            "DATA --tokenizer train:8192, then --data DATA"
        )
    return files


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
