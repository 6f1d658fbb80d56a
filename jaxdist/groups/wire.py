"""How arrays travel between a JAX process and its sidecar, and between sidecars when a group
heals: a message is a JSON header (its own fields and, per array, its dtype and shape) and the
arrays' raw bytes, back to back. Nothing is unpickled: a peer can send numbers, not code.

Imported by both interpreters (the sidecar runs this file's directory as its own path): the
standard library and numpy only.
"""

import json
import socket
import struct

import numpy as np

_LENGTHS = struct.Struct("<QQ")  # header bytes, data bytes
MAX_HEADER = 1 << 26
"""A header longer than this is refused (a confused or hostile peer, not a model's arrays)."""


class WireError(RuntimeError):
    """A message that is not this format, or a peer that went away mid-message."""


def pack(header: dict, arrays: list) -> tuple[bytes, list[memoryview]]:
    """(the header's bytes with the arrays' dtypes and shapes, the arrays' raw buffers)."""
    described = [(a.dtype.name, list(a.shape)) for a in arrays]
    head = json.dumps({**header, "arrays": described}).encode()
    return head, [memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays]


def unpack(head: bytes, data: bytes | memoryview) -> tuple[dict, list]:
    """The header and the arrays (views into `data`, in its dtypes: a dtype numpy does not know
    here, such as bfloat16 in the sidecar, stays raw bytes)."""
    header = json.loads(head)
    arrays, at = [], 0
    for dtype, shape in header.pop("arrays"):
        try:
            kind = np.dtype(dtype)
        except TypeError:
            kind = None
        n = int(np.prod(shape, dtype=np.int64)) * (kind.itemsize if kind else _width(dtype))
        if at + n > len(data):
            raise WireError(f"array of {dtype}{shape} runs past the message's {len(data)} bytes")
        raw = np.frombuffer(data, np.uint8, n, at)
        arrays.append(raw.view(kind).reshape(shape) if kind else raw)
        at += n
    if at != len(data):
        raise WireError(f"message holds {len(data)} bytes, its arrays {at}")
    return header, arrays


def _width(dtype: str) -> int:
    widths = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
    if dtype not in widths:
        raise WireError(f"unknown dtype {dtype!r}")
    return widths[dtype]


def send(sock: socket.socket, header: dict, arrays: list = ()) -> None:
    head, buffers = pack(header, list(arrays))
    sock.sendall(_LENGTHS.pack(len(head), sum(b.nbytes for b in buffers)) + head)
    for b in buffers:
        sock.sendall(b)


def _exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError("the peer closed the connection mid-message")
        got += k
    return buf


def receive(sock: socket.socket) -> tuple[dict, list]:
    head_n, data_n = _LENGTHS.unpack(_exactly(sock, _LENGTHS.size))
    if head_n > MAX_HEADER:
        raise WireError(f"a header of {head_n} bytes (at most {MAX_HEADER})")
    head = _exactly(sock, head_n)
    return unpack(bytes(head), _exactly(sock, data_n))


def raw(header: dict, arrays: list) -> tuple[bytes, bytes]:
    """A message as two byte strings (what a sidecar keeps, and sends a healing peer)."""
    head, buffers = pack(header, arrays)
    return head, b"".join(bytes(b) for b in buffers)
