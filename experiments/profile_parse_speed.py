"""How fast does `jaxdist profile` read traces? MB of trace per second, on a trace it captures.

    python experiments/profile_parse_speed.py            # tiny on 8 CPU devices, 20 steps

Captures `--steps` traced steps of a training run (op-level CPU events on), then times loading
and attributing the trace `--repeats` times and prints the size, events and MB/s.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="jaxdist-parse-"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxdist.cli",
            "train",
            "--model",
            args.model,
            "--mesh",
            args.mesh,
            "--devices",
            "cpu:8",
            "--steps",
            str(args.steps + 2),
            "--profile",
            f"1:{args.steps + 1}",
            "--run-dir",
            str(run_dir),
            "--checkpoint-every",
            "1000",
            "--log-every",
            "1000",
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    from jaxdist.profiling.breakdown import breakdown
    from jaxdist.profiling.xplane import find_xplane, load

    trace = find_xplane(run_dir / "profile")
    size = trace.stat().st_size
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        loaded = load(trace)
        report = breakdown(loaded)
        times.append(time.perf_counter() - t0)
    best = min(times)
    print(
        f"{trace.name}: {size / 1e6:.1f} MB, {len(loaded.events):,} op events, "
        f"{report['summary']['steps']} steps x {report['summary']['devices']} devices; "
        f"load + attribute {best:.2f} s = {size / 1e6 / best:.1f} MB/s "
        f"({len(loaded.events) / best:,.0f} events/s)"
    )


if __name__ == "__main__":
    main()
