"""`jaxdist profile`'s report of the hand-written trace (tests/cpu_trace.py): its collectives
beside the alpha-beta model and its fleet-law projection, worked out on paper, and the one
answer it gives whichever path of a run it is pointed at."""

import io
import json
import os

import pytest

from jaxdist.cli.main import main
from jaxdist.hardware import get_hardware
from jaxdist.profiling.report import profile
from tests import cpu_trace
from tests.xspace import write

MS = 1_000_000  # ns
US = 1e-6  # s


def test_hand_written_trace_beside_the_alpha_beta_model(tmp_path):
    model = profile(cpu_trace.write_trace(tmp_path), cpu_trace.HLO, cpu_trace.MESH, "cpu")["model"]
    link = get_hardware("cpu").inner
    alpha, beta = 15e-6, 1.6e9
    assert (link.alpha_s, link.bandwidth) == (alpha, beta)  # the figures worked with below
    rows = {r["kind"]: r for r in model["per_axis"]}
    assert set(rows) == {"all-reduce", "all-gather"}
    # all-reduce: once in every device-step, 1024 bytes over 2 devices, a ring's
    # 2(p-1) alpha + 2(p-1)/p n / beta; measured (300 + 150 + 100 + 200) / 4 = 187.5 us.
    ar = rows["all-reduce"]
    assert (ar["group_size"], ar["bytes"]) == (2, 1024)
    assert ar["predicted_s"] == pytest.approx(2 * alpha + 1024 / beta)
    assert ar["measured_s"] == pytest.approx(187.5 * US)
    assert ar["exposed_s"] == pytest.approx(162.5 * US)
    # all-gather: in step 11 only, so half a gather of 32768 bytes per device-step, each
    # (p-1) alpha + (p-1)/p n / beta; measured (0 + 0 + 100 + 100) / 4 = 50 us, all hidden.
    ag = rows["all-gather"]
    assert ag["bytes"] == 32768 / 2
    assert ag["predicted_s"] == pytest.approx(0.5 * (alpha + 0.5 * 32768 / beta))
    assert (ag["measured_s"], ag["exposed_s"]) == (pytest.approx(50 * US), 0)
    # The fleet law from the 2 traced devices: 2 x 587.5 us of compute to spread; the data
    # axis's all-reduce (1024 bytes) is the gradient; overlap and sync keep their measured
    # shares of the mean communication, 75 / 237.5 and 62.5 / 237.5.
    assert model["gradient_bytes_per_step"] == 1024
    one, two = model["projection"][:2]
    assert one == pytest.approx(
        {"devices": 1, "compute_s": 1175 * US, "comm_s": 0, "sync_s": 0, "overlap_s": 0,
         "step_s": 1175 * US, "efficiency": 1.0}
    )  # fmt: skip
    comm2 = 2 * alpha + 1024 / beta
    step2 = 587.5 * US + comm2 + comm2 * 62.5 / 237.5 - comm2 * 75 / 237.5
    assert two == pytest.approx(
        {"devices": 2, "compute_s": 587.5 * US, "comm_s": comm2, "sync_s": comm2 * 62.5 / 237.5,
         "overlap_s": comm2 * 75 / 237.5, "step_s": step2, "efficiency": 1175 * US / (2 * step2)}
    )  # fmt: skip
    # Exposed (comm + sync - overlap = 225/237.5 of comm) passes compute (1175 us / N) first at
    # N = 16. Past a few devices the all-reduce is priced as the faster of the ring and the
    # tree, 2 log2(N) alpha + 2 x 1024 / beta: at N = 8 the ring's 14 alpha + 1.75 x 1024 /
    # beta = 211.1 us, the tree's 6 alpha + 1.28 us = 91.3 us, exposed 86.5 < 146.9 us; at
    # N = 16 the tree's 8 alpha + 1.28 us = 121.3 us, exposed 114.9 > 73.4 us.
    assert model["comm_dominates_at"] == 16
    assert model["projection"][-1]["devices"] == 4096
    assert model["projection"][-1]["efficiency"] < 0.001


def test_profile_of_a_run_dir_is_that_of_its_profile_folder(tmp_path, capsys, monkeypatch):
    """`jaxdist profile RUN_DIR`, `RUN_DIR/profile` and the trace file itself: one report,
    with the per-axis table and the projection from the hlo.txt and mesh.json the trainer
    left in RUN_DIR/profile, never the newer trace of a watch window."""
    run = tmp_path / "run"
    logdir = run / "profile"
    trace = cpu_trace.write_trace(logdir / "plugins" / "profile" / "2026_01_01_00_00_00")
    (logdir / "hlo.txt").write_text(cpu_trace.HLO)
    (logdir / "mesh.json").write_text(json.dumps(cpu_trace.MESH))
    (run / "metrics.jsonl").write_text("")
    later = run / "watch" / "step_20" / "plugins" / "profile" / "2026_01_01_00_05_00"
    ev = ("fusion.9", 0, MS, {"hlo_op": "fusion.9", "device_ordinal": 0, "run_id": 3})
    watch = write(later, {"/host:CPU": {"t": [ev]}})
    os.utime(watch, (trace.stat().st_mtime + 60,) * 2)
    out, err = {}, {}
    for name, path in {"run": run, "profile": logdir, "file": trace}.items():
        assert main(["profile", str(path), "--json", str(tmp_path / f"{name}.json")]) == 0
        out[name], err[name] = capsys.readouterr()
    reports = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in out}
    assert reports["run"] == reports["profile"] == reports["file"]
    assert out["run"] == out["profile"] == out["file"]
    rep = reports["run"]
    assert rep["source"] == str(trace)
    assert {(r["axis"], r["kind"]) for r in rep["model"]["per_axis"]} == {
        ("data", "all-reduce"),
        ("data", "all-gather"),
    }
    assert "collectives per mesh axis" in out["run"]
    assert "N=4096: 0%" in out["run"] and rep["model"]["comm_dominates_at"] == 16
    # The report on stdout, its warnings on stderr (`> report.txt` keeps the report alone).
    said = " ".join(err["run"].split())
    assert "warning:" not in out["run"] and "warning: projection: at 16 devices" in said
    # `--json -` is stdout, as for plan and train --compile-only: the JSON alone, no file "-".
    monkeypatch.chdir(tmp_path)
    assert main(["profile", str(run), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == rep and not (tmp_path / "-").exists()


def test_no_projection_without_the_compiled_hlo(tmp_path, capsys):
    """Without hlo.txt and mesh.json no collective has bytes: no projection, not 100%."""
    trace = cpu_trace.write_trace(tmp_path)
    rep = profile(trace)
    assert rep["model"]["projection"] == [] and rep["model"]["comm_dominates_at"] is None
    assert rep["model"]["per_axis"] == [] and rep["model"]["gradient_bytes_per_step"] is None
    png = tmp_path / "b.png"
    assert main(["profile", str(tmp_path), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "no projection" in printed and "N=4096" not in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --hlo and --mesh stand in for the missing files.
    (tmp_path / "prog.hlo").write_text(cpu_trace.HLO)
    args = ["profile", str(trace), "--hlo", str(tmp_path / "prog.hlo"), "--mesh", "data=2"]
    assert main([*args, "--json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["model"]["comm_dominates_at"] == 16
    capsys.readouterr()
    assert main(["profile", str(trace), "--hlo", str(tmp_path / "missing.txt")]) == 2
    assert "--hlo" in capsys.readouterr().err


def test_profile_of_a_folder_attributes_each_step_by_the_program_the_run_saved(tmp_path, capsys):
    """A step that ran another program (replica groups' outer step) is attributed by that
    program's HLO, which the trainer saves beside the trace (report.save); `jaxdist profile`
    of the folder reads it back and prints what the run printed, row for row."""
    from rich.console import Console

    from jaxdist.metrics.progress import FILE_WIDTH
    from jaxdist.profiling import report

    logdir = tmp_path / "profile"
    cpu_trace.write_trace(logdir / "plugins" / "profile" / "2026_01_01_00_00_00")
    # Step 11's program gathers [128,128] floats where the main program gathers [64,128].
    outer = cpu_trace.HLO.replace("f32[64,128]", "f32[128,128]")
    report.save(logdir, cpu_trace.HLO, cpu_trace.MESH, "h100", {11: outer})
    rep = report.profile_saved(logdir)
    # As the trainer prints it to a log file (metrics.progress.console_for, not a terminal).
    console = Console(file=io.StringIO(), width=FILE_WIDTH, soft_wrap=True)
    report.print_report(rep, console, console)
    ran = console.file.getvalue()
    assert main(["profile", str(tmp_path / "profile"), "--json", str(tmp_path / "p.json")]) == 0
    again = capsys.readouterr().out
    assert json.loads((tmp_path / "p.json").read_text()) == json.loads(json.dumps(rep))
    gathered = {
        (r["step"], r["device"]): r["by_axis"]["data"].get("all-gather", {}).get("bytes")
        for r in rep["steps"]
    }
    # Step 10 gathers nothing; step 11 the bytes of its own program, not the main one's.
    assert gathered == {(10, 0): None, (10, 1): None, (11, 0): 65536, (11, 1): 65536}
    assert rep["hardware"] == "h100"  # the run's hardware, not the command's default
    # Every row and figure the run printed, the command prints (its warnings go to stderr).
    assert [ln for ln in ran.splitlines() if not ln.startswith("warning")] == again.splitlines()
    assert "0.033" in again and "all-gather" in again
