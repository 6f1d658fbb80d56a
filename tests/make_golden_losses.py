"""Makes tests/golden/default_run_losses.json: the first 50 losses of the default run (`jaxdist
train`, no flags: tiny on 8 fake CPU devices, data=2,fsdp=2,tensor=2, the embedded corpus, seed
0, 300 steps) on CPU, as float32 bit patterns, which tests/test_golden.py checks bit for bit.

The golden file changes only through this script, and only for a stated reason:

    .venv/bin/python tests/make_golden_losses.py --reason "why the losses changed"

It runs the default job itself (with --log-every 1, which only logs more), then the shorter
run the test makes (50 steps; --decay-steps 300 keeps the 300-step run's learning-rate
schedule, and the batch of a step depends only on the seed and the step), and writes nothing
unless the two agree in every bit: the test's shortcut is proven each time the file is made.
It records the command, the library versions, the machine, the date and the reason.

XLA:CPU compiles for the host's vector instructions (AVX-512 or AVX2, FMA), so another CPU may
give other last bits from the same program. A host whose CPU differs from the one that made the
file adds its own losses beside them, at the same numerics:

    .venv/bin/python tests/make_golden_losses.py --add-cpu

which writes only where the library versions are the file's and every loss is within
ADD_RTOL of its losses (last bits, not another computation). A remake (--reason) drops the
other CPUs' losses: the numerics changed for them too.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import struct
import subprocess
import sys
import tempfile

OUT = pathlib.Path(__file__).parent / "golden" / "default_run_losses.json"
STEPS = 50
# The default job, logging every step.
FULL = ["train", "--log-every", "1"]
# What the test runs: the same first 50 steps (the save interval changes no number).
SHORT = ["train", "--steps", str(STEPS), "--decay-steps", "300", "--log-every", "1"]
SHORT += ["--checkpoint-every", str(STEPS)]
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "grain")
# The vector extensions XLA:CPU's code depends on (LLVM compiles for the host's).
VECTOR_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16")
ADD_RTOL = 1e-4


def float32_hex(value: float) -> str:
    """The float32 bit pattern of a logged loss (a float32 widened to a Python float)."""
    packed = struct.pack("<f", value)
    if struct.unpack("<f", packed)[0] != value:
        raise ValueError(f"{value!r} is not a float32 value")
    return f"0x{struct.unpack('<I', packed)[0]:08x}"


def losses(run_dir: pathlib.Path) -> list[float]:
    """The first STEPS losses logged in run_dir/metrics.jsonl, step by step."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in records if "loss" in r}
    missing = [s for s in range(STEPS) if s not in by_step]
    if missing:
        raise SystemExit(f"{run_dir}: no loss logged for steps {missing}")
    return [by_step[s] for s in range(STEPS)]


def versions() -> dict:
    found = {"python": platform.python_version()}
    found |= {name: importlib.metadata.version(name) for name in PACKAGES}
    return found


def cpu_vector() -> str:
    """This host's vector extensions among VECTOR_FLAGS ("avx avx2 fma"), or its processor
    name where /proc/cpuinfo is not there to read."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    lines = [x for x in text.splitlines() if x.startswith("flags")]
    flags = lines[0].split(":", 1)[1].split() if lines else []
    return " ".join(f for f in VECTOR_FLAGS if f in flags)


def machine() -> dict:
    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpus": os.cpu_count(),
        "cpu_vector": cpu_vector(),
    }


def _add_cpu(record: dict, full: list[float], full_hex: list[str]) -> dict:
    """`record` with this host's losses beside its own (--add-cpu), refused in one line where
    they are not the same numerics on another CPU."""
    here, made = cpu_vector(), record["host"].get("cpu_vector", "not recorded")
    if here == made:
        raise SystemExit(f"this host's CPU ({here}) made the file: nothing to add")
    if record["versions"] != versions():
        raise SystemExit(f"library versions {versions()} differ from the file's: remake it")
    worst = max(abs(a - b) / abs(b) for a, b in zip(full, record["losses"], strict=True))
    if worst > ADD_RTOL:
        raise SystemExit(f"losses differ by up to {worst:.1e} relative: not last bits; remake it")
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    entry = {"date": now, "host": machine(), "max_rel_diff": worst, "losses": full}
    entry["losses_float32_hex"] = full_hex
    return record | {"other_cpus": {**record.get("other_cpus", {}), here: entry}}


def _train(argv: list[str], run_dir: pathlib.Path, env: dict) -> list[float]:
    cmd = [sys.executable, "-m", "jaxdist.cli", *argv, "--run-dir", str(run_dir)]
    print("running:", " ".join(cmd), flush=True)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return losses(run_dir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--reason", help="why the golden losses are (re)made")
    which.add_argument("--add-cpu", action="store_true", help="add this host's CPU's losses")
    args = p.parse_args()
    if args.reason is not None and not args.reason.strip():
        raise SystemExit("--reason must say why the losses changed")
    with tempfile.TemporaryDirectory(prefix="jaxdist-golden-") as tmp:
        tmp = pathlib.Path(tmp)
        # On CPU whatever this host has; a private compile cache, not the user's.
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXDIST_COMPILE_CACHE": str(tmp / "xla")}
        full = _train(FULL, tmp / "full", env)
        short = _train(SHORT, tmp / "short", env)
    full_hex, short_hex = [float32_hex(x) for x in full], [float32_hex(x) for x in short]
    if full_hex != short_hex:
        bad = [s for s in range(STEPS) if full_hex[s] != short_hex[s]]
        raise SystemExit(
            f"the {STEPS}-step run the test makes differs from the default run at steps {bad}; "
            "nothing written: tests/test_golden.py's shortcut no longer holds"
        )
    if args.add_cpu:
        record = _add_cpu(json.loads(OUT.read_text()), full, full_hex)
        OUT.write_text(json.dumps(record, indent=1) + "\n")
        print(f"added {cpu_vector()!r} to {OUT}")
        return 0
    record = {
        "reason": args.reason.strip(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "jaxdist " + " ".join(FULL),
        "test_command": "jaxdist " + " ".join(SHORT),
        "made_by": "tests/make_golden_losses.py",
        "versions": versions(),
        "host": machine(),
        "losses": full,
        "losses_float32_hex": full_hex,
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}: steps 0..{STEPS - 1}, loss {full[0]:.4f} -> {full[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
