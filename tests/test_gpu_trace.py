"""The profile parser on a real GPU trace: five `gpt2-124m` steps traced on one H200 by
experiments/h200.py (`train --profile 3:8`, command buffers off), trimmed by
tests/make_gpu_trace.py. Beside it, the truth that script read on the GPU machine without the
parser: each step's busy time as the union of its raw kernel intervals."""

import json
import pathlib
import shutil

import pytest

from jaxdist.cli.main import main
from jaxdist.profiling.report import profile

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "gpu_trace"
TRACE = FIXTURE / "gpt2_124m_h200.xplane.pb"
TRUTH = json.loads((FIXTURE / "gpt2_124m_h200.truth.json").read_text())


def test_parser_busy_time_is_the_raw_kernels_union_on_an_h200_trace():
    report = profile(TRACE, hardware="h200")
    assert report["platform"] == "gpu"
    rows = {(x["step"], str(x["device"])): x for x in report["steps"]}
    truth = {(t["step"], dev): t for dev, ts in TRUTH["devices"].items() for t in ts}
    assert sorted(rows) == sorted(truth) and len(rows) == 5
    for key, t in truth.items():
        row = rows[key]
        # busy = the step less its idle time; the truth merged ~1,600 kernels per step itself
        assert row["step_s"] - row["idle_s"] == pytest.approx(t["busy_s"], rel=0, abs=1e-9), key
        # One GPU: nothing is communication, and compute, exposed copies and idle tile the step.
        assert row["comm_s"] == 0 and row["sync_s"] == 0
        parts = row["compute_s"] + row["memcpy_exposed_s"] + row["idle_s"]
        assert parts == pytest.approx(row["step_s"], rel=1e-9), key
        assert 0.7 < row["compute_s"] / row["step_s"] < 1  # a step of GEMMs, not of gaps


def test_profile_command_reads_a_gpu_trace_on_a_cpu_host(tmp_path, capsys):
    shutil.copy(TRACE, tmp_path / "vm.xplane.pb")  # the command may write beside its trace
    assert main(["profile", str(tmp_path), "--json", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert [x["step"] for x in rep["steps"]] == TRUTH["steps"]
    assert "compute" in capsys.readouterr().out
