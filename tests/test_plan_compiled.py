"""The planner against the compilers: its memory and bytes beside what XLA compiles for the
same layouts (CPU, TPU, GPU), `--verify` and `--compile-only` choosing as the plan does."""

import importlib.util
import json

import pytest

from jaxdist.cli.main import main
from jaxdist.layout import StepConfig
from jaxdist.planning.inputs import PlanConfig
from jaxdist.planning.planner import plan, price
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from tests.extras import needs_gpu_aot, needs_tpu
from tests.helpers import cli
from tests.helpers import planned as _model

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _compiled_figures(row: dict, batch: int) -> tuple[int, int]:
    """XLA's per-device peak and the HLO's collective bytes for a planned layout, compiled here
    in the test process as `plan --verify` compiles it (float32 on CPU, AdamW)."""
    from jaxdist.compiled import hlo
    from jaxdist.config import OptimConfig
    from jaxdist.layout import Layout
    from jaxdist.mesh import MeshConfig, build_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build
    from models.presets import model_spec

    mc = get_model_config("tiny", compute_dtype="float32")
    mesh = build_mesh(MeshConfig(ici=tuple(row["mesh"].items())))
    tx, lr = make_optimizer(OptimConfig(), 100)
    step = StepConfig(row["microbatches"])
    layout = Layout.on(mesh, STANDARD_RULES, step, batch_size=batch, seq_len=mc.seq_len)
    c = build(model_spec(mc).init, tx, lr, layout, mesh)
    exe = c.compile_abstract((batch, mc.seq_len + 1))
    m = exe.memory_analysis()
    # Arguments, outputs and temporaries, the donated state (aliased to its output) once.
    peak = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    sent = sum(x.bytes * x.executions for x in hlo.collectives(exe.as_text(), dict(mesh.shape)))
    return peak, sent


@pytest.mark.slow
# The small batch under -m experiment (the suite's time).
@pytest.mark.parametrize("batch", [512, pytest.param(16, marks=pytest.mark.experiment)])
def test_verify_on_cpu_agrees_with_xla(tmp_path, capsys, batch):
    """The issue's bar: memory within 15% and collective bytes within 5% of the compiled step,
    for every verified layout, at the default batch and a small one. The best layout is
    compiled again here, so the test measures the planner against XLA, not `verify` against
    its own figures."""
    out = tmp_path / f"plan{batch}.json"
    args = ["plan", "--model", "tiny", "--devices", "8", "--hardware", "cpu"]
    # In this process (its 8 fake CPU devices are the ones --verify asks for): no start-up
    # of a second one, and the compile below is then this session's cached program.
    rc = main([*args, "--verify", "3", "--batch-size", str(batch), "--json", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert "every verified layout within" in stdout
    verified = [row for row in json.loads(out.read_text())["layouts"] if "verify" in row]
    assert len(verified) == 3
    # What verify sets beside the prediction is XLA's figure for the layout.
    peak, sent = _compiled_figures(verified[0], batch)
    assert sent > 0
    v = verified[0]["verify"]
    assert (v["xla_peak_bytes"], v["hlo_collective_bytes"]) == (peak, sent)
    for row in verified:
        v = row["verify"]
        # ... and the prediction beside it is the planner's own row.
        assert v["predicted_peak_bytes"] == row["memory_bytes"]["peak"]
        assert v["predicted_collective_bytes"] == row["comm_bytes"]
        mem, comm = row["memory_bytes"]["peak"], row["comm_bytes"]
        assert abs(mem / v["xla_peak_bytes"] - 1) <= 0.15, (row["layout"], v)
        assert abs(comm / v["hlo_collective_bytes"] - 1) <= 0.05, (row["layout"], v)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install 'jaxdist[tpu]')")
def test_compile_for_a_tpu_slice_from_a_cpu_host():
    r = cli(
        "train",
        "--model",
        "tiny",
        "--mesh",
        "data=2,fsdp=4",
        "--batch-size",
        "16",
        "--compile-only",
        "--target",
        "tpu-v5p:2x2x2",
        "--json",
        "-",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["platform"] == "tpu" and "v5" in report["device_kind"]
    assert report["fits"] and report["per_device_bytes"]["peak_estimate"] > 0
    axes = {c["axis"] for c in report["collectives"]}
    assert "fsdp" in axes  # the FSDP gathers are there, compiled by the TPU compiler
    assert "xla_flops" not in report  # XLA counts a loop's body once: no such ratio is shown


@pytest.mark.slow
def test_interleaving_shrinks_the_priced_bubble_and_its_sends_match_the_hlo():
    import jax
    import numpy as np

    from jaxdist.compiled import hlo
    from tests.helpers import mesh_for

    model = _model("tiny", "float32", num_layers=8)
    sizes = {"pipeline": 4, "data": 2}

    def priced(schedule):
        cfg = PlanConfig(8, "cpu", 16, StepConfig(4, schedule, virtual_stages=2))
        return price(sizes, [model], STANDARD_RULES, cfg)

    plain, interleaved = priced("1f1b"), priced("interleaved")
    assert plain["bubble_s"] / plain["compute_s"] == pytest.approx(3 / 4)  # (p-1)/m
    assert interleaved["bubble_s"] / interleaved["compute_s"] == pytest.approx(3 / 8)  # /(vm)

    from jaxdist.config import OptimConfig
    from jaxdist.layout import Layout
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build
    from models.transformer import Transformer

    mc = get_model_config("tiny", num_layers=8)
    mesh = mesh_for("pipeline=4,data=2")
    tx, lr = make_optimizer(OptimConfig(), 10)
    step = StepConfig(4, "interleaved", virtual_stages=2)
    c = build(
        lambda r: Transformer(mc, r),
        tx,
        lr,
        Layout.on(mesh, STANDARD_RULES, step, batch_size=16, seq_len=mc.seq_len),
        mesh,
    )
    batch = jax.ShapeDtypeStruct((16, mc.seq_len + 1), np.int32, sharding=c.batch_sharding)
    text = c.step_fn.lower(c.abstract_state, batch).compile().as_text()
    measured = hlo.summarize(hlo.collectives(text, dict(mesh.shape)))
    sent = measured[("pipeline", "collective-permute")]["bytes"]
    assert interleaved["expected"]["pipeline|collective-permute"] == pytest.approx(sent, rel=0.05)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install 'jaxdist[tpu]')")
def test_plan_verifies_against_the_tpu_compiler(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "tiny", "--devices", "8", "--hardware", "v5p-16"]
    r = cli(*args, "--batch-size", "64", "--verify", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())["layouts"][0]
    v = row["verify"]
    assert v["platform"] == "tpu" and v["xla_peak_bytes"] > 0
    # Whatever the agreement, the planner's own prediction is set beside the TPU compiler's
    # figure and a disagreement is flagged, not hidden. (That the figures are XLA's and the
    # ratio theirs is checked against a compile of its own by test_verify_on_cpu_agrees_with_xla.)
    assert v["predicted_peak_bytes"] == row["memory_bytes"]["peak"]
    assert ("FLAG" in r.stdout) == (not (v["memory_ok"] and v["bytes_ok"]))


# A study (a pipelined 1B compiled for TPU, about 100 s on CI's two cores): -m experiment.
# The suite keeps test_plan_verifies_against_the_tpu_compiler on a smaller model.
@pytest.mark.experiment
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install 'jaxdist[tpu]')")
def test_planner_agrees_with_the_tpu_compiler_on_a_pipelined_1b(tmp_path):
    """The issue's bar on 64 v5p chips, the preset's remat: memory within 15% and collective
    bytes within 5% of the TPU compiler's for the best layout and the best pipelined one
    (whose stage gathers its weights once per step, and whose tick loop the TPU compiler
    counts twice: memory.predict's `tpu_copies`)."""
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "1b", "--devices", "64", "--hardware", "v5p-128", "--remat", "dots"]
    r = cli(*args, "--axes", "pipeline,fsdp", "--verify", "2", "--json", str(out), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["layouts"][:2]
    assert [row["mesh"]["pipeline"] for row in rows] == [1, 2]
    for row in rows:
        v = row["verify"]
        assert v["platform"] == "tpu" and v["predicted_peak_bytes"] == row["memory_bytes"]["peak"]
        assert v["memory_ok"] and v["bytes_ok"], (row["layout"], v)
    assert row["memory_bytes"]["tpu_copies"] > 0


PLAN_AND_TRAIN = [
    pytest.param(
        # 38 s of the suite's time: -m experiment; the h100:8 case holds the same in the suite.
        "v5p-16", ["--hardware", "v5p-16"], "v5p-16", 256, marks=[pytest.mark.experiment, needs_tpu]
    ),
    pytest.param(
        "h100:8", ["--hardware", "h100", "--devices", "8"], "h100:8", 128,
        marks=[pytest.mark.slow, needs_gpu_aot],
    ),
]  # fmt: skip


@pytest.mark.parametrize("name, hardware, target, batch", PLAN_AND_TRAIN)
def test_plan_and_compile_only_choose_one_policy_at_one_predicted_peak(
    tmp_path, name, hardware, target, batch
):
    """One price (jaxdist.planning.memory.device_peak) and one chooser: `plan --mesh` and
    `train --compile-only --target` of the same layout take the same remat policy (here not
    the fastest: `none` does not fit at this batch) at the same predicted peak, and the
    compiler holds that peak within 10% and the program fits."""
    step = ["--model", "1b", "--mesh", "fsdp=8", "--batch-size", str(batch), "--seq-len", "2048"]
    out = tmp_path / "plan.json"
    assert main(["plan", *step, *hardware, "--json", str(out)]) == 0
    row = json.loads(out.read_text())["layouts"][0]
    assert row["remat"] == "dots", row["remat"]  # none is predicted too big at this batch
    r = cli("train", *step, "--compile-only", "--target", target, "--json", "-", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["remat"] == {"policy": row["remat"], "tried": [row["remat"]]}
    assert report["predicted_peak_bytes"] == pytest.approx(row["memory_bytes"]["peak"], rel=1e-9)
    assert abs(report["memory_ratio"] - 1) <= 0.10, report["memory_ratio"]
    assert report["fits"]
    # The plan prints the command that runs its choice, with every setting it assumed.
    assert row["microbatches"] == 1 and "--remat dots" in json.loads(out.read_text())["command"]


def test_a_compile_that_does_not_fit_prints_its_table_and_exits_1(capsys):
    """The verdict on a report that does not fit (the compile itself: the study below): the
    short table on stdout, one line on stderr, exit 1; a report that fits exits 0."""
    from jaxdist.cli.compile_report import finish

    report = {
        "model": "m", "device_kind": "TPU v5p", "platform": "tpu", "mesh": {"fsdp": 8},
        "batch_size": 8, "seq_len": 64, "remat": "full",
        "per_device_bytes": {"peak_estimate": 110e9},
        "predicted_peak_bytes": 100e9, "device_memory_bytes": 102.8e9, "peak_gib": 102.4,
        "usable_gib": 95.73, "device_gib": 95.73, "fits": False,
        "collectives": [{"axis": "fsdp", "kind": "all-gather", "count": 3, "bytes": 2e9}],
    }  # fmt: skip
    assert finish(report, None) == 1
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and "collectives per step" in out and "2.000" in out
    # The plan's rule (jaxdist.planning.fit.verdict), its margin stated, in GiB as the table.
    said = "the step does not fit: compiled peak 102.45 GiB of 95.74 GiB usable (no margin: XLA's"
    assert said in err and said.removeprefix("the step ") in out
    assert all(len(line) <= 100 for line in out.splitlines())
    assert finish(report | {"fits": True}, None) == 0


# The same through a real compile for a TPU (about 30 s on CI's two cores): -m experiment.
@pytest.mark.experiment
@needs_tpu
def test_compile_only_exits_non_zero_when_the_program_does_not_fit(tmp_path):
    """A step the TPU compiler accepts but whose peak is over what the chip gives a program:
    a short table on stdout, the verdict on stderr, exit 1 (a script can tell)."""
    step = ["--model", "tiny-llama", "--mesh", "fsdp=8", "--batch-size", "32768"]
    r = cli("train", *step, "--seq-len", "2048", "--remat", "full", "--compile-only",
            "--target", "v5p-16", "--json", str(tmp_path / "r.json"))  # fmt: skip
    report = json.loads((tmp_path / "r.json").read_text())
    assert r.returncode == 1 and not report["fits"], r.stderr[-2000:]
    assert report["per_device_bytes"]["peak_estimate"] > report["device_memory_bytes"]
    assert "DOES NOT FIT" in r.stdout and "collectives per step" in r.stdout
    assert "the step does not fit" in r.stderr


def test_verify_recommends_the_first_layout_that_fits_once_compiled(monkeypatch):
    """`--verify K`: a layout the compiler refuses or that does not fit is never the choice."""
    from jaxdist.cli import cmd_plan
    from jaxdist.compiled import aot

    verdicts = iter([False, True, True])
    monkeypatch.setattr(aot, "verify", lambda *a: {"fits": next(verdicts)})
    args = cmd_plan.Plan(model="tiny", hardware="cpu", devices=8, batch_size=16, verify=3)
    result = plan(_model("tiny", "float32"), STANDARD_RULES, PlanConfig(8, "cpu", 16))
    cmd_plan._verify(args, get_model_config("tiny", compute_dtype="float32"), result, [])
    assert result["best"] == 1
    verdicts = iter([False, False, False])
    cmd_plan._verify(args, get_model_config("tiny", compute_dtype="float32"), result, [])
    assert result["best"] is None


# About 8 minutes on two shared cores (compiling Llama-3-8B for 64 chips): -m experiment.
@pytest.mark.experiment
@needs_tpu
def test_the_readme_plan_compiles_as_printed_and_fits_by_the_plans_rule():
    """The README's TPU plan, its printed first choice compiled as printed (with the target
    it names): one rule (jaxdist.planning.fit.verdict) says "fits" for the prediction, with its
    10% margin, and for XLA's compiled peak, with none, and the compiler holds the prediction
    within that margin. Measured: predicted 86.11 GiB, compiled 89.92 GiB of 95.73 (0.958)."""
    import shlex

    from jaxdist.hardware import get_hardware
    from jaxdist.planning import fit
    from tests.test_readme import ROOT, commands, one_line, readme_blocks

    lines = [ln for _, _, block in readme_blocks((ROOT / "README.md").read_text()) for ln in block]
    line = next(one_line(c) for c in commands(lines) if c.startswith("jaxdist plan") and "v5p" in c)
    r = cli(*shlex.split(line)[1:], "--json", "-")
    assert r.returncode == 0, r.stderr[-2000:]
    planned = json.loads(r.stdout.strip().splitlines()[-1])
    row, hw = planned["layouts"][planned["best"]], get_hardware(planned["hardware"])
    assert fit.verdict(row["memory_bytes"]["peak"], hw.memory_bytes, hw.platform).fits
    target = ["--compile-only", "--target", planned["check_target"], "--json", "-"]
    r = cli(*shlex.split(planned["command"])[1:], *target, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    peak = report["per_device_bytes"]["peak_estimate"]
    compiled = fit.verdict(peak, report["device_memory_bytes"], report["platform"], False)
    assert compiled.fits and report["fits"]
    assert abs(row["memory_bytes"]["peak"] / peak - 1) <= 1 - fit.PREDICTION_MARGIN


# XLA's GPU compiler (jax 0.11.2) compiling tiny-llama at batch 65,536, seq 2048, fsdp=8, remat
# full for h100:8; its memory analysis: 88.44 GiB of buffers (0.06 of arguments, 88.38 of
# temporaries).
REMAT_LINE = (
    "W1207 05:14:27.325077    4880 hlo_rematerialization.cc:3363] Can't reduce memory use below "
    "60.06GiB (64492914014 bytes) by rematerialization; only reduced to 96.38GiB (103484115181 "
    "bytes), down from 100.51GiB (107926374703 bytes) originally"
)


def test_xlas_rematerialization_line_is_set_beside_the_table(capfd):
    """What XLA's C++ writes on file descriptor 2 while compiling is caught and passed on, and
    its "only reduced to" is printed beside the compiled peak with what each one counts."""
    import io
    import os

    from rich.console import Console

    from jaxdist.cli.compile_report import print_report
    from jaxdist.compiled.memory import remat_said, xla_said

    with xla_said() as (said, live):
        os.write(2, (REMAT_LINE + "\n").encode())  # as XLA's logging writes it
        live.write("shown meanwhile\n")
    assert said == [REMAT_LINE]
    err = capfd.readouterr().err
    assert err.index("shown meanwhile") < err.index(REMAT_LINE)  # passed on, in order
    remat = remat_said(["other", REMAT_LINE])
    assert remat == {
        "limit_bytes": 64492914014,
        "reached_bytes": 103484115181,
        "before_bytes": 107926374703,
    }
    assert remat_said(["nothing"]) is None
    report = {
        "model": "tiny-llama", "device_kind": "H100", "platform": "gpu", "mesh": {"fsdp": 8},
        "batch_size": 65536, "seq_len": 2048, "remat": "full",
        "per_device_bytes": {"peak_estimate": 88.44 * 2**30}, "predicted_peak_bytes": 80 * 2**30,
        "collectives": [], "xla_remat": remat,
    }  # fmt: skip
    console = Console(file=io.StringIO(), width=100)
    print_report(report, console)
    out = " ".join(console.file.getvalue().split())
    assert (
        'XLA\'s rematerialization said "only reduced to 96.38GiB" (its limit 60.06): its own '
        "count of the program before fusion and buffer assignment; the compiled peak, 88.44 "
        "GiB, is the buffers the finished program allocates, the figure the verdict reads"
    ) in out
