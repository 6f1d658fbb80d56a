"""Makes a GPU trace test fixture: a profiled run's trace trimmed to its annotated steps, and
beside it the raw-kernel truth, read without jaxdist's parser.

    python tests/make_gpu_trace.py RUN_DIR/profile OUT_DIR [--name gpt2_124m_h200]

writes OUT_DIR/NAME.xplane.pb and OUT_DIR/NAME.truth.json. The device call of
experiments/h200.py runs it on the GPU machine (so that what comes back is small).

Kept: every line of each `/device:GPU:N` plane, only its events that start inside an annotated
step; of `/host:CPU`, only the step annotations (events with a `step_num` stat). Dropped: host
threads, the metadata and environment planes, stats that are not numbers or strings. The file
is written by tests/xspace.py, so a reader sees the same events and stats, nothing else.

The truth is the device's busy time in each step: the union of the kernel intervals on its
`Stream #` lines (with command buffers off each kernel, copy and memset is one event there,
from CUPTI) that start between the step's annotation and the next one's, measured by merging
sorted intervals. It does not use the parser's classification, windows or interval sets.
"""

import argparse
import importlib.util
import json
import pathlib
import re

from jax.profiler import ProfileData

from jaxdist.errors import ConfigError
from jaxdist.profiling.xplane import find_xplane


def _xspace_writer():
    """tests/xspace.py's `write`, loaded from beside this file: run as a script on another
    machine, a `tests` package installed there must not stand in for this one."""
    path = pathlib.Path(__file__).with_name("xspace.py")
    spec = importlib.util.spec_from_file_location("jaxdist_tests_xspace", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write


DEVICE = re.compile(r"^/device:GPU:(\d+)$")


def _stats(event) -> dict:
    return {k: v for k, v in event.stats if k and isinstance(v, int | float | str)}


def _steps(planes) -> list[tuple[int, float, float]]:
    steps = []
    for plane in planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for e in line.events:
                s = _stats(e)
                if "step_num" in s:
                    steps.append((int(s["step_num"]), e.start_ns, e.duration_ns))
    if not steps:
        raise SystemExit("no step annotations in the trace: profile with `jaxdist train --profile`")
    return sorted(steps, key=lambda s: s[1])


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def trim(src: pathlib.Path, out_dir: pathlib.Path, name: str) -> dict:
    """Writes the trimmed trace and its truth; returns the truth."""
    planes = list(ProfileData.from_file(str(src)).planes)
    steps = _steps(planes)
    starts = [s[1] for s in steps]
    bounds = [
        (num, a, b) for (num, a, _), b in zip(steps, [*starts[1:], float("inf")], strict=True)
    ]

    def step_of(t: float) -> int | None:
        return next((num for num, a, b in bounds if a <= t < b), None)

    kept: dict = {"/host:CPU": {"steps": [("train", a, d, {"step_num": n}) for n, a, d in steps]}}
    truth: dict = {"source": src.name, "steps": [n for n, _, _ in steps], "devices": {}}
    for plane in planes:
        m = DEVICE.match(plane.name)
        if not m:
            continue
        lines, kernels = {}, {n: [] for n, _, _ in steps}
        for line in plane.lines:
            events = []
            for e in line.events:
                step = step_of(e.start_ns)
                if step is None:
                    continue
                events.append((e.name, e.start_ns, e.duration_ns, _stats(e)))
                if line.name.startswith("Stream #") and e.duration_ns > 0:
                    kernels[step].append((e.start_ns, e.start_ns + e.duration_ns))
            if events:
                lines[line.name] = events
        kept[plane.name] = lines
        truth["devices"][m.group(1)] = [
            {"step": n, "kernels": len(kernels[n]), "busy_s": _union(kernels[n]) * 1e-9}
            for n, _, _ in steps
        ]
    if not truth["devices"]:
        raise SystemExit(f"{src}: no /device:GPU:N plane; this tool trims GPU traces")
    out_dir.mkdir(parents=True, exist_ok=True)
    _xspace_writer()(out_dir / f"{name}.xplane.pb", kept)
    (out_dir / f"{name}.truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    return truth


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", help="a .xplane.pb, or a directory holding one (the newest)")
    ap.add_argument("out_dir")
    ap.add_argument("--name", default="gpt2_124m_h200")
    args = ap.parse_args()
    try:  # locating the file only; nothing of the parser reads it
        src = find_xplane(args.trace)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    truth = trim(src, pathlib.Path(args.out_dir), args.name)
    print(json.dumps(truth))


if __name__ == "__main__":
    main()
