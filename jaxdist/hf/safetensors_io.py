"""Safetensors in and out, a slice at a time: the weight format Hugging Face models ship in.

Reading: `SafetensorsDir` opens a model directory's `model.safetensors`, or the shards its
`model.safetensors.index.json` names, and reads any rectangular slice of a tensor without
reading the rest (safetensors' `get_slice` maps the file). `load_sharded` builds global jax
arrays from such slices: `jax.make_array_from_callback` asks only for the pieces this process's
devices hold, so no process reads, or holds, more than its shards and the one block it is
converting.

Writing: `write` streams tensors produced one at a time into safetensors files, sharded with
an index past `max_shard_bytes`. The library's own writer takes a whole dict of arrays in
memory; since every shape and dtype is known in advance, the header is written first and each
tensor's bytes follow as they are produced, so only one tensor is ever held. Files are read
back with the library (the tests do), which checks the header and offsets.
"""

import json
import math
import pathlib
import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxdist.errors import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# The safetensors dtype names for the dtypes a model's weights come in.
DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...
    file: pathlib.Path


class SafetensorsDir:
    """The tensors of a model directory, by name: shapes and dtypes from the headers alone."""

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"{index} is not a safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise ConfigError(
                f"{self.directory} holds no weights: neither {SINGLE} nor {INDEX} (with its "
                "shards); pass a Hugging Face model directory saved with safetensors"
            )
        missing = [f for f in files if not (self.directory / f).is_file()]
        if missing:
            raise ConfigError(
                f"{self.directory}: weight file{'s' * (len(missing) > 1)} "
                f"{', '.join(missing)} named by {INDEX} "
                f"{'are' if len(missing) > 1 else 'is'} missing; copy the whole model directory"
            )
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            path = self.directory / name
            try:
                with safe_open(str(path), framework="numpy") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        self.tensors[key] = TensorInfo(tuple(s.get_shape()), s.get_dtype(), path)
            except Exception as e:  # the Rust side raises its own error types
                raise ConfigError(f"{path} is not a readable safetensors file ({e})") from None

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The slice `index` (one slice per dim) of tensor `name`; nothing else is read."""
        info = self.tensors[name]
        with safe_open(str(info.file), framework="numpy") as f:
            if not info.shape:
                return np.asarray(f.get_tensor(name))
            return np.asarray(f.get_slice(name)[index])

    def dtype(self) -> str:
        """The weights' dtype, as a numpy name (the most common, if they are mixed)."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.dtype] = counts.get(t.dtype, 0) + math.prod(t.shape)
        top = max(counts, key=counts.__getitem__)
        return DTYPES[top].name if top in DTYPES else "float32"


def concrete(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A device's index with its open ends (None) made the dims' bounds."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def load_sharded(
    targets: dict[str, jax.ShapeDtypeStruct],
    fill: Callable[[str, tuple[slice, ...]], np.ndarray],
) -> dict[str, jax.Array]:
    """Global arrays laid out as `targets` say (each a ShapeDtypeStruct with its sharding):
    `fill(name, index)` makes each block this process's devices hold, and only those."""
    out = {}
    for name, t in targets.items():

        def block(index, name=name, t=t):
            return fill(name, concrete(index, t.shape)).astype(t.dtype, copy=False)

        out[name] = jax.make_array_from_callback(t.shape, t.sharding, block)
    return out


class Planned(NamedTuple):
    """A tensor to write: its name, shape and numpy dtype, known before its values are."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def shard_files(plan: list[Planned], max_shard_bytes: int) -> list[list[Planned]]:
    """The tensors grouped, in order, into files of at most `max_shard_bytes` (a tensor
    larger than that gets a file of its own)."""
    files: list[list[Planned]] = [[]]
    size = 0
    for p in plan:
        if files[-1] and size + p.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(p)
        size += p.nbytes
    return files


def write(
    directory: pathlib.Path,
    plan: list[Planned],
    produce: Callable[[Planned], np.ndarray],
    max_shard_bytes: int,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Writes the planned tensors, each made by `produce` when its turn comes, as
    model.safetensors or as model-0000i-of-0000n.safetensors shards with their index.
    Returns the file names."""
    groups = shard_files(plan, max_shard_bytes)
    names = (
        [SINGLE]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    for name, group in zip(names, groups, strict=True):
        _write_file(directory / name, group, produce, metadata or {"format": "pt"})
    if len(groups) > 1:
        weight_map = {p.name: n for n, g in zip(names, groups, strict=True) for p in g}
        index = {"metadata": {"total_size": sum(p.nbytes for p in plan)}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _write_file(
    path: pathlib.Path,
    group: Iterable[Planned],
    produce: Callable[[Planned], np.ndarray],
    metadata: dict[str, str],
) -> None:
    group = list(group)
    header: dict = {"__metadata__": metadata}
    offset = 0
    for p in group:
        if p.dtype not in _NAMES:
            raise ConfigError(f"{p.name}: dtype {p.dtype} cannot be written as safetensors")
        header[p.name] = {
            "dtype": _NAMES[p.dtype],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format's 8-byte alignment of the data
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for p in group:
            value = np.ascontiguousarray(produce(p))
            if value.shape != p.shape or value.dtype != p.dtype:
                raise ValueError(
                    f"{p.name}: produced {value.shape} {value.dtype}, planned {p.shape} {p.dtype}"
                )
            f.write(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())
