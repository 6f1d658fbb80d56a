"""FP8 priced (jaxdist.planning.fp8, planning.compute): the projections the model runs in FP8
(jaxdist.kernels.fp8.worth_fp8) at the FP8 peak on the same efficiency curve as bf16's, their
casts at HBM bandwidth, the head and attention unchanged; `plan --fp8` sets each layout beside
itself in bf16, and refuses hardware without FP8 units."""

import dataclasses
import math

import pytest

from jaxdist.cli.main import main
from jaxdist.errors import ConfigError
from jaxdist.hardware import get_hardware
from jaxdist.layout import StepConfig
from jaxdist.planning import compute, fp8
from jaxdist.planning.inputs import PlanConfig
from jaxdist.planning.layouts import layout_of
from jaxdist.planning.planner import price
from meshes.presets import STANDARD_RULES
from models.inventory import plan_model
from models.presets import get_model_config


def _model(name: str, **over):
    return plan_model(get_model_config(name, compute_dtype="bfloat16", **over))


def _priced(model, hardware: str, sizes: dict, batch: int, **step) -> dict:
    cfg = PlanConfig(math.prod(sizes.values()), hardware, batch, StepConfig(**step))
    return price(sizes, [model], STANDARD_RULES, cfg)


def test_llama3_8b_on_h100_gains_from_fp8_with_every_projection_admitted():
    # torchtitan's Llama-3.1-8B layout (FSDP over 8 H100s, 2 rows of 8,192 per GPU).
    model = _model("llama3-8b", seq_len=8192, remat="full")
    for recipe in ("current", "delayed"):
        row = _priced(model, "h100", {"fsdp": 8}, 16, fp8=recipe)
        f = row["fp8"]
        assert (f["projections"], f["of"]) == (5, 5)  # q/k/v, out, up, gate, down
        assert 1 < f["speedup"] < 2
        assert f["speedup"] < f["compute_speedup"] < 2  # communication does not speed up
        assert f["cast_s"] > 0
    # The bf16 figure is the same layout priced with --fp8 off: one price, not a copy.
    off = _priced(model, "h100", {"fsdp": 8}, 16)
    assert "fp8" not in off and off["compute_by_kind"]["fp8_cast"] == 0
    assert f["bf16_step_s"] == pytest.approx(off["step_s"])


def test_a_tiny_model_keeps_its_projections_in_bf16():
    model = _model("tiny")
    row = _priced(model, "h100", {"fsdp": 8}, 16, fp8="current")
    assert row["fp8"]["projections"] == 0 and row["fp8"]["of"] == 4
    assert row["fp8"]["speedup"] == pytest.approx(1.0)
    # Forced into FP8 (--fp8-filter none), its narrow GEMMs do not win back their casts.
    forced = _priced(model, "h100", {"fsdp": 8}, 16, fp8="current", fp8_filter="none")
    assert forced["fp8"]["projections"] == 4 and forced["fp8"]["speedup"] < 1


def test_hardware_without_fp8_units_is_refused_in_one_line(capsys):
    model = _model("tiny")
    for hardware in ("tpu-v5p", "tpu-v6e", "a100"):
        with pytest.raises(ConfigError, match=f"on {hardware}: no FP8 matrix units"):
            _priced(model, hardware, {"fsdp": 8}, 16, fp8="delayed")
    assert main(["plan", "--model", "tiny", "--hardware", "v5p-16", "--fp8", "current"]) == 2
    err = capsys.readouterr().err.strip()
    assert "on tpu-v5p: no FP8 matrix units" in err and len(err.splitlines()) == 1


def test_fp8_gemms_run_at_twice_the_rate_on_the_same_curve_and_pay_their_casts():
    hw = get_hardware("h100")
    assert hw.fp8_peak_flops == pytest.approx(2 * hw.peak_flops, rel=1e-3)
    L, K, N, T = 4, 4096, 8192, 1000.0
    up = compute.Matmul(L * K * N, K, N, True)
    work = compute.Work(L, K, N, 256, 2048, K, (up,))
    quantized = dataclasses.replace(work, matmuls=(dataclasses.replace(up, fp8=True),))
    bf16 = compute.seconds(work, T, hw, compute_bytes=2)
    fast = compute.seconds(quantized, T, hw, compute_bytes=2, weight_passes=3)
    ratio = hw.peak_flops / hw.fp8_peak_flops
    assert fast["matmul"] == pytest.approx(bf16["matmul"] * ratio)
    # Input [T, K] and output gradient [T, N] per layer, the weight [K, N] per pass: each
    # read twice in 2 bytes (amax, then the cast) and written once in 1.
    moved = (T * L * (K + N) + 3 * L * K * N) * 5
    assert compute.fp8_cast_bytes(quantized, T, 1, 2, 3) == pytest.approx(moved)
    assert fast["fp8_cast"] == pytest.approx(moved / hw.hbm_bandwidth)
    assert fast["total"] == pytest.approx(
        bf16["total"] - bf16["matmul"] * (1 - ratio) + moved / hw.hbm_bandwidth
    )


def test_the_rule_reads_each_projection_in_its_direction():
    # d 1024, d_mlp 4096: worth_fp8 skips a GEMM to at most 4096 from at most 1024, so the
    # up and gate projections (1024 -> 4096), q/k/v (1024 -> 3072) and the output (1024 ->
    # 1024) stay in bf16; the down projection (4096 -> 1024) runs in FP8.
    sizes = dict(d_model=1024, d_mlp=4096, num_heads=16, num_kv_heads=16)
    work = compute.work_of(_model("llama-124m", **sizes))
    cfg = PlanConfig(8, "h100", 16, StepConfig(fp8="current"))
    layout = layout_of({"fsdp": 8}, STANDARD_RULES, cfg, 1024)
    admitted = fp8.admit(work, layout, get_hardware("h100"))
    quantized = [(m.embed, m.other, m.embed_in) for m in fp8.projections(admitted) if m.fp8]
    assert quantized == [(1024, 4096, False)] and len(fp8.projections(admitted)) == 5
    assert not any(m.fp8 for m in admitted.matmuls if not m.in_layers)  # the head
    none = dataclasses.replace(layout, step=StepConfig(fp8="current", fp8_filter="none"))
    assert all(m.fp8 for m in fp8.projections(fp8.admit(work, none, get_hardware("h100"))))


def test_plan_shows_each_layout_beside_itself_in_bf16(capsys):
    args = ["plan", "--model", "llama3-8b", "--seq-len", "8192", "--devices", "8"]
    args += ["--batch-size", "16", "--hardware", "h100", "--fp8", "current", "--top", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "vs bf16" in out and "5 of 5 projection kinds in FP8" in out
    assert "--fp8 current" in out  # the command that runs the choice
    assert "a pipeline axis with --fp8" in out  # the step refuses those layouts
