"""Serialized XSpace traces written byte by byte, so a test knows every interval in them.

The schema is tsl's profiler/protobuf/xplane.proto (package tensorflow.profiler):

    XSpace         { repeated XPlane planes = 1; repeated string hostnames = 4; }
    XPlane         { int64 id = 1; string name = 2; repeated XLine lines = 3;
                     map<int64, XEventMetadata> event_metadata = 4;
                     map<int64, XStatMetadata> stat_metadata = 5; repeated XStat stats = 6; }
    XLine          { int64 id = 1; string name = 2; int64 timestamp_ns = 3;
                     repeated XEvent events = 4; }
    XEvent         { int64 metadata_id = 1; int64 offset_ps = 2; int64 duration_ps = 3;
                     repeated XStat stats = 4; }
    XStat          { int64 metadata_id = 1; double double_value = 2; int64 int64_value = 4;
                     string str_value = 5; }
    XEventMetadata { int64 id = 1; string name = 2; }
    XStatMetadata  { int64 id = 1; string name = 2; }

A map entry is a message {key = 1; value = 2}. Wire format: each field is a varint key
(field number << 3 | wire type), then a varint (type 0), eight little-endian bytes (type 1) or a
varint length and the bytes (type 2). int64 negatives are ten-byte two's complement varints.
The reader under test, `jax.profiler.ProfileData`, is XLA's; nothing here comes from it.
"""

import pathlib
import struct

Stats = dict[str, int | float | str]
# {plane name: {line name: [(event name, start ns, duration ns, {stat: value})]}}
Planes = dict[str, dict[str, list[tuple[str, float, float, Stats]]]]


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int(field: int, n: int) -> bytes:
    return _varint(field << 3) + _varint(n)


def _len(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _stat(metadata_id: int, value: int | float | str) -> bytes:
    if isinstance(value, str):
        body = _len(5, value.encode())
    elif isinstance(value, float):
        body = _varint(2 << 3 | 1) + struct.pack("<d", value)
    else:
        body = _int(4, value)
    return _int(1, metadata_id) + body


class _Ids:
    """Metadata ids of one plane: names of events and of stats, numbered from 1."""

    def __init__(self) -> None:
        self.events: dict[str, int] = {}
        self.stats: dict[str, int] = {}

    def event(self, name: str) -> int:
        return self.events.setdefault(name, len(self.events) + 1)

    def stat(self, name: str) -> int:
        return self.stats.setdefault(name, len(self.stats) + 1)


def _line(line_id: int, name: str, events: list, ids: _Ids) -> bytes:
    # Like the profiler's own, a line's events are offsets from its first event's start.
    t0 = int(min((e[1] for e in events), default=0))
    out = _int(1, line_id) + _len(2, name.encode()) + _int(3, t0)
    for ev_name, start, dur, stats in events:
        ev = _int(1, ids.event(ev_name))
        ev += _int(2, round((start - t0) * 1000)) + _int(3, round(dur * 1000))
        for k, v in stats.items():
            ev += _len(4, _stat(ids.stat(k), v))
        out += _len(4, ev)
    return out


def _plane(plane_id: int, name: str, lines: dict, stats: Stats) -> bytes:
    ids = _Ids()
    out = _int(1, plane_id) + _len(2, name.encode())
    for i, (line_name, events) in enumerate(lines.items(), 1):
        out += _len(3, _line(i, line_name, events, ids))
    for k, v in stats.items():
        out += _len(6, _stat(ids.stat(k), v))
    for n, i in ids.events.items():
        out += _len(4, _int(1, i) + _len(2, _int(1, i) + _len(2, n.encode())))
    for n, i in ids.stats.items():
        out += _len(5, _int(1, i) + _len(2, _int(1, i) + _len(2, n.encode())))
    return out


def xspace(
    planes: Planes, plane_stats: dict[str, Stats] | None = None, hostname: str = "host"
) -> bytes:
    """The serialized XSpace of `planes`; `plane_stats` adds plane-level stats by plane name."""
    out = b""
    for i, (name, lines) in enumerate(planes.items(), 1):
        out += _len(1, _plane(i, name, lines, (plane_stats or {}).get(name, {})))
    return out + _len(4, hostname.encode())


def write(path: pathlib.Path, planes: Planes, plane_stats: dict[str, Stats] | None = None):
    """The trace as a file: `path` itself if it ends in .pb, else host.xplane.pb inside it."""
    if path.suffix != ".pb":
        path = path / "host.xplane.pb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(xspace(planes, plane_stats))
    return path
