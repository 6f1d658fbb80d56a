"""A split of a tokenized data directory: random access to windows of tokens, read in place.

Nothing is read up front but the manifest (and, once, every shard's checksum, streamed through
the page cache): a window is read from its shard when a batch asks for it, so a process's
memory stays flat however large the dataset, and it reads only its own rows.
"""

import os
import pathlib

import numpy as np

from jaxdist.data import manifest as mf
from jaxdist.errors import ConfigError


class TokenSet:
    """One tokenized data directory: its manifest, checked against its shards."""

    def __init__(self, directory: str | pathlib.Path, verify: bool = True):
        self.directory = pathlib.Path(directory)
        if not self.directory.is_dir():
            raise ConfigError(
                f"data directory {self.directory} does not exist; pass the --out of "
                "`jaxdist tokenize`"
            )
        self.manifest = mf.read(self.directory)
        if verify:
            mf.verify(self.directory, self.manifest)

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    def split(self, name: str) -> mf.Split:
        return self.manifest.splits.get(name, mf.Split())

    def tokens_per_byte(self, name: str) -> float | None:
        split = self.split(name)
        return split.num_tokens / split.text_bytes if split.text_bytes else None

    def stream(self, name: str) -> "TokenStream":
        return TokenStream(self.directory, self.split(name), self.manifest.dtype)


class TokenStream:
    """The concatenated shards of one split, as one flat sequence of tokens.

    Windows are read with pread, not through a memory map: mapped file pages count towards the
    process's resident set, and on this kernel a random read faults in a whole large folio of
    the page cache (measured: ~330 KB of RSS per 258-byte window, with or without
    MADV_RANDOM), so a mapped reader's RSS grows with every window it has ever read. pread
    copies just the window; the page cache (not counted in RSS) still serves repeats."""

    def __init__(self, directory: pathlib.Path, split: mf.Split, dtype: str):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        shards = [s for s in split.shards if s.num_tokens]
        self._paths = [directory / s.tokens_file for s in shards]
        self._fds: list[int] | None = None
        self._starts = np.concatenate(
            [[0], np.cumsum([s.num_tokens for s in shards], dtype=np.int64)]
        )
        self.num_tokens = int(self._starts[-1])

    def __len__(self) -> int:
        return self.num_tokens

    def __del__(self):
        for fd in self._fds or ():
            os.close(fd)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int32, across shard boundaries."""
        if self._fds is None:  # opened on first read: a reader that never reads holds no fds
            self._fds = [os.open(p, os.O_RDONLY) for p in self._paths]
        raw = np.empty(length, self.dtype)
        view = memoryview(raw).cast("B")
        size = self.dtype.itemsize
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < length:
            offset = start + done - int(self._starts[shard])
            n = min(length - done, int(self._starts[shard + 1] - self._starts[shard]) - offset)
            piece = view[done * size : (done + n) * size]
            got = os.preadv(self._fds[shard], [piece], offset * size)
            if got != n * size:
                raise ConfigError(
                    f"shard {self._paths[shard]} ended early (read {got} of {n * size} bytes at "
                    f"token {offset}); it changed after it was verified: tokenize it again"
                )
            done += n
            shard += 1
        return raw.astype(np.int32)


class TokenWindows:
    """Random access to windows of `length` tokens of a stream; neighbours share one token."""

    def __init__(self, stream: TokenStream, length: int):
        self.stream, self.length = stream, length

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // (self.length - 1))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.stream.read(i * (self.length - 1), self.length)
