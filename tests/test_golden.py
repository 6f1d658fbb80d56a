"""The default run's first 50 losses, bit for bit: tests/golden/default_run_losses.json, made
(only) by tests/make_golden_losses.py with the reason it was made. Any change of any loss in
any bit fails here: a change of numerics (init, data order, optimizer, a kernel, a library
upgrade) is then either a bug or a deliberate change, regenerated with a stated reason.

XLA:CPU compiles for the host's vector instructions, so the bits are those of the CPU that made
them: a host with another CPU is held to its own losses where the file has them (`--add-cpu`),
else to the file's within the last bits (ADD_RTOL), saying so."""

import importlib.metadata
import json
import os
import pathlib
import warnings

import numpy as np
import pytest

from tests.helpers import cli
from tests.make_golden_losses import (
    ADD_RTOL,
    FULL,
    OUT,
    PACKAGES,
    SHORT,
    STEPS,
    cpu_vector,
    float32_hex,
    losses,
)


def golden() -> dict:
    return json.loads(OUT.read_text())


def test_golden_file_records_how_and_why_it_was_made():
    g = golden()
    assert g["made_by"] == "tests/make_golden_losses.py" and g["reason"].strip()
    assert g["command"] == "jaxdist " + " ".join(FULL)
    assert g["test_command"] == "jaxdist " + " ".join(SHORT)
    assert set(PACKAGES) <= set(g["versions"]) and g["date"]
    assert len(g["losses_float32_hex"]) == STEPS
    # The readable losses are the bit patterns' values (an edit by hand shows).
    assert [float32_hex(x) for x in g["losses"]] == g["losses_float32_hex"]
    for cpu, entry in g.get("other_cpus", {}).items():
        assert entry["host"]["cpu_vector"] == cpu != g["host"].get("cpu_vector")
        assert [float32_hex(x) for x in entry["losses"]] == entry["losses_float32_hex"]
        assert len(entry["losses"]) == STEPS


def _for_this_cpu(g: dict) -> tuple[dict, str]:
    """The losses this host is held to, and the CPU that made them: its own CPU's where the
    file has them, else the file's (made on a CPU it may not record)."""
    here, made = cpu_vector(), g["host"].get("cpu_vector", "not recorded")
    other = g.get("other_cpus", {})
    if here != made and here in other:
        return other[here], here
    return g, made


def _mismatch(g: dict, want_entry: dict, cpu: str, got_hex: list[str], got: list[float]) -> str:
    want, wanted = want_entry["losses_float32_hex"], want_entry["losses"]
    bad = [s for s in range(STEPS) if got_hex[s] != want[s]]
    first = bad[0]
    then = g["versions"]
    now = {name: importlib.metadata.version(name) for name in PACKAGES}
    changed = {k: f"{then.get(k)} -> {v}" for k, v in now.items() if then.get(k) != v}
    return (
        f"{len(bad)} of {STEPS} losses differ from {OUT.name} (made {g['date']}: "
        f"{g['reason']!r}); first at step {first}: golden {wanted[first]!r} "
        f"({want[first]}), now {got[first]!r} ({got_hex[first]}); library versions changed: "
        f"{changed or 'none'}; the golden's CPU: {cpu}, this host's: {cpu_vector()}. If the "
        "change is intended, regenerate: .venv/bin/python tests/make_golden_losses.py --reason "
        '"..." (if only the CPU differs: --add-cpu)'
    )


@pytest.mark.slow
def test_default_run_first_losses_are_bitwise_golden(tmp_path: pathlib.Path):
    g = golden()
    run_dir = tmp_path / "run"
    # A process of its own, under the host's XLA flags alone (as the golden file was made):
    # the suite's own flags (tests/conftest.py) change how XLA:CPU compiles, and so last bits.
    flags = {"XLA_FLAGS": os.environ["JAXDIST_TEST_USER_XLA_FLAGS"]}
    run = cli(*SHORT, "--run-dir", str(run_dir), timeout=600, env=flags)
    assert run.returncode == 0, run.stderr[-3000:]
    got = losses(run_dir)
    got_hex = [float32_hex(x) for x in got]
    want, cpu = _for_this_cpu(g)
    if cpu not in (cpu_vector(), "not recorded"):  # another CPU's, none of this one's
        warnings.warn(
            f"golden losses made on a CPU with {cpu}, this host has {cpu_vector()}: held to "
            f"rtol {ADD_RTOL}, not bit for bit (make_golden_losses.py --add-cpu adds its own)",
            stacklevel=1,
        )
        np.testing.assert_allclose(got, want["losses"], rtol=ADD_RTOL)
        return
    assert got_hex == want["losses_float32_hex"], _mismatch(g, want, cpu, got_hex, got)
