"""The default run's first 50 losses, bit for bit: tests/golden/default_run_losses.json, made
(only) by tests/make_golden_losses.py with the reason it was made. Any change of any loss in
any bit fails here: a change of numerics (init, data order, optimizer, a kernel, a library
upgrade) is then either a bug or a deliberate change, regenerated with a stated reason."""

import importlib.metadata
import json
import pathlib

import pytest

from jaxdist.cli.main import main
from tests.make_golden_losses import FULL, OUT, PACKAGES, SHORT, STEPS, float32_hex, losses


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


def _mismatch(g: dict, got_hex: list[str], got: list[float]) -> str:
    want = g["losses_float32_hex"]
    bad = [s for s in range(STEPS) if got_hex[s] != want[s]]
    first = bad[0]
    then = g["versions"]
    now = {name: importlib.metadata.version(name) for name in PACKAGES}
    changed = {k: f"{then.get(k)} -> {v}" for k, v in now.items() if then.get(k) != v}
    return (
        f"{len(bad)} of {STEPS} losses differ from {OUT.name} (made {g['date']}: "
        f"{g['reason']!r}); first at step {first}: golden {g['losses'][first]!r} "
        f"({want[first]}), now {got[first]!r} ({got_hex[first]}); library versions changed: "
        f"{changed or 'none'}. If the change is intended, regenerate: .venv/bin/python "
        'tests/make_golden_losses.py --reason "..."'
    )


@pytest.mark.slow
def test_default_run_first_losses_are_bitwise_golden(tmp_path: pathlib.Path):
    g = golden()
    run_dir = tmp_path / "run"
    assert main([*SHORT, "--run-dir", str(run_dir)]) == 0
    got = losses(run_dir)
    got_hex = [float32_hex(x) for x in got]
    assert got_hex == g["losses_float32_hex"], _mismatch(g, got_hex, got)
