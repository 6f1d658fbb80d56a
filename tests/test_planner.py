"""The planner: its arithmetic, its rankings and its refusals (its predictions against the
compilers: tests/test_plan_compiled.py)."""

import importlib.util
import math

import pytest

from jaxdist.cli.main import main
from jaxdist.compiled.tpu import parse_target, topology_name
from jaxdist.errors import ConfigError
from jaxdist.parallel.experts import dispatch_rows
from jaxdist.planning.inputs import PlanConfig
from jaxdist.planning.planner import plan, price
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from tests.helpers import planned as _model

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def test_ranked_by_the_fleet_law():
    # Without remat (the 1b preset's default saves only matmul outputs, and then fits).
    result = plan(
        _model("1b", remat="none"),
        STANDARD_RULES,
        PlanConfig(devices=64, hardware="h100-ib", batch_size=512, max_layouts=50),
    )
    rows = result["layouts"]
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    for r in rows:
        assert r["fits"]
        assert 0 <= r["overlap_s"] <= min(r["compute_s"], r["comm_s"])
        # Every layout uses all 64 devices, and its name is its mesh.
        assert _product(r["mesh"]) == 64
        assert r["layout"] == ",".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1)
    assert len({r["layout"] for r in rows}) == len(rows)  # each layout priced once
    # 1B params of fp32 state and AdamW moments on every device plus 16K tokens of activations
    # do not fit an 80 GB H100: plain data parallelism is priced but refused.
    assert result["naive"]["layout"] == "data=64" and not result["naive"]["fits"]
    assert result["naive"]["memory_bytes"]["params"] == pytest.approx(4 * 1015.7e6, rel=1e-3)


def test_two_layouts_worked_on_paper():
    """The planner's rows for tiny on 2 H100s, data=2 and tensor=2, against the fleet law
    worked by hand from the model's sizes and hardware.toml's [h100] figures."""
    result = plan(
        _model("tiny", "float32"),
        STANDARD_RULES,
        PlanConfig(
            devices=2,
            hardware="h100",
            batch_size=512,
            axes=("data", "tensor"),
            compute_efficiency=0.5,  # one flat share of peak: the fleet law alone
        ),
    )
    rows = {r["layout"]: r for r in result["layouts"]}
    assert list(rows) == ["data=2", "tensor=2"]  # fastest first
    # [h100]: 989 TFLOP/s; NVLink alpha 15 us, beta 370 GB/s (2 devices share a host of 8);
    # overlap 0.7 of the hideable traffic; jitter 0.02 of compute.
    peak, alpha, beta, overlap, jitter = 989e12, 15e-6, 370e9, 0.7, 0.02
    # tiny: GPT-2 style, L=2 layers, D=128, 4 heads of 32 (4 KV heads), F=512, V=256, T=128.
    # Weights: wqkv 2*128*4*3*32 = 98,304; wo 2*4*32*128 = 32,768; w_up and w_down
    # 2*128*512 = 131,072 each; head 128*256 = 32,768: 425,984 in matmuls. Embeddings
    # 256*128 + 128*128 = 49,152, norms (2 per layer and the final one, scale and bias)
    # 2*(2*2*128 + 128) = 1,280: 476,416 parameters.
    params = 425_984 + 49_152 + 1_280
    # Training FLOPs per token (PaLM): 6 x 425,984 + 12 L D T = 2,555,904 + 393,216.
    flops = 6 * 425_984 + 12 * 2 * 128 * 128
    assert (params, flops) == (476_416, 2_949_120)
    tokens = 512 * 128
    compute = flops * tokens / (2 * peak) / 0.5  # spread over 2 devices at 50% of peak
    sync = jitter * compute * math.sqrt(2 * math.log(2))  # the slower of 2: sigma sqrt(2 ln N)
    # data=2: every gradient, fp32, all-reduced over 2 devices, one message per layer (2):
    # 2 x [2(p-1) alpha + 2(p-1)/p (n/2) / beta] = 4 alpha + n / beta. Gradient sums hide
    # behind compute: 0.7 of them, less than compute.
    dp_bytes = 4 * params
    dp_comm = 4 * alpha + dp_bytes / beta
    dp_overlap = overlap * dp_comm
    # tensor=2: partial sums of [B,T,D] = 512*128*128 fp32 per layer, forward attention and
    # MLP outputs, backward QKV and MLP-up input gradients (4 per layer, 8 in all), plus the
    # vocab-split embedding lookup and head input gradient (2), and the loss's max, sum and
    # target over [B,T] (3 of 512*128 fp32): on the critical path, never hidden.
    btd = 512 * 128 * 128 * 4
    tp_bytes = 8 * btd + 2 * btd + 3 * 512 * 128 * 4
    tp_comm = 4 * alpha + tp_bytes / beta
    want = {
        "data=2": dict(
            comm_bytes=dp_bytes,
            comm_s=dp_comm,
            comm_exposed_s=0.0,
            overlap_s=dp_overlap,
            step_s=compute + dp_comm + sync - dp_overlap,
        ),
        "tensor=2": dict(
            comm_bytes=tp_bytes,
            comm_s=tp_comm,
            comm_exposed_s=tp_comm,
            overlap_s=0.0,
            step_s=compute + tp_comm + sync,
        ),
    }
    assert (dp_bytes, tp_bytes) == (1_905_664, 336_330_752)
    for layout, w in want.items():
        row = rows[layout]
        w |= {"compute_s": compute, "bubble_s": 0.0, "sync_s": sync}
        assert {k: row[k] for k in w} == pytest.approx(w, rel=1e-9, abs=0), layout
        assert row["tokens_per_s"] == pytest.approx(tokens / w["step_s"], rel=1e-9)
        assert row["mfu"] == pytest.approx(flops * tokens / (w["step_s"] * 2 * peak), rel=1e-9)
    assert rows["data=2"]["by_axis"] == {
        "data all-reduce": {"bytes": dp_bytes, "seconds": pytest.approx(dp_comm, rel=1e-9)}
    }
    assert rows["tensor=2"]["by_axis"] == {
        "tensor all-reduce": {"bytes": tp_bytes, "seconds": pytest.approx(tp_comm, rel=1e-9)}
    }


def _product(sizes: dict) -> int:
    out = 1
    for n in sizes.values():
        out *= n
    return out


def test_sharding_divides_state_and_tensor_parallelism_is_exposed():
    model, cfg = _model("1b"), PlanConfig(devices=8, hardware="h100-nvlink", batch_size=64)
    dp = price({"data": 8}, [model], STANDARD_RULES, cfg)
    fsdp = price({"fsdp": 8}, [model], STANDARD_RULES, cfg)
    tp = price({"tensor": 8}, [model], STANDARD_RULES, cfg)
    # FSDP splits parameters and moments 8 ways (all but the small unsharded vectors).
    assert fsdp["memory_bytes"]["params"] < dp["memory_bytes"]["params"] / 7.5
    # Gradient reductions hide behind compute; tensor-parallel partial sums cannot.
    assert dp["comm_exposed_s"] == 0 and dp["overlap_s"] > 0
    assert tp["comm_exposed_s"] > 0
    # The sync term grows with the fleet: sqrt(2 ln N).
    big = price({"data": 64}, [model], STANDARD_RULES, PlanConfig(64, "h100-ib", 512))
    assert big["sync_s"] / big["compute_s"] > dp["sync_s"] / dp["compute_s"]


def test_a_model_that_fits_nowhere_names_the_way_out():
    with pytest.raises(ConfigError, match=r"fits no layout.*--remat full.*devices"):
        plan(_model("1b"), STANDARD_RULES, PlanConfig(devices=2, hardware="cpu", batch_size=512))


def test_devices_that_do_not_factor_name_the_nearest_count(capsys):
    cfg = PlanConfig(devices=7, hardware="cpu", batch_size=16)
    with pytest.raises(ConfigError, match="nearest device count that works: 8"):
        plan(_model("tiny", "float32"), STANDARD_RULES, cfg)
    args = ["--model", "tiny", "--devices", "3", "--hardware", "cpu", "--axes", "tensor"]
    assert main(["plan", *args]) == 2
    assert "nearest device count that works: 2" in capsys.readouterr().err


def test_unknown_axis_and_hardware_are_refused():
    with pytest.raises(ConfigError, match="--axes"):
        plan(_model("tiny"), STANDARD_RULES, PlanConfig(8, "cpu", 16, axes=("data", "model")))
    with pytest.raises(ConfigError, match="unknown hardware"):
        plan(_model("tiny"), STANDARD_RULES, PlanConfig(8, "mi300x", 16))


def test_tpu_topology_names():
    assert topology_name("v5p", 64) == "v5p:4x4x4"
    assert topology_name("v5p", 8) == "v5p:2x2x2"
    assert topology_name("v5p", 16) == "v5p:2x2x4"
    assert topology_name("v5p", 4) == "v5p:2x2x1"  # one host; libtpu refuses 1x2x2
    assert topology_name("v5e", 16) == "v5e:4x4"
    assert parse_target("tpu-v5p:4x4x4") == "v5p:4x4x4"
    assert parse_target("v5p-128") == "v5p:4x4x4"  # Google Cloud's name: 64 chips
    with pytest.raises(ConfigError, match="powers of two"):
        topology_name("v5p", 48)
    with pytest.raises(ConfigError, match="tpu-v5p:2x2x2"):
        parse_target("v5p")


def test_target_without_compile_only_is_refused(capsys):
    rc = main(["train", "--model", "tiny", "--target", "tpu-v5p:2x2x2", "--steps", "1"])
    assert rc == 2 and "--compile-only" in capsys.readouterr().err


def test_expert_layouts_for_a_moe_model():
    model, cfg = _model("tiny-moe", "float32"), PlanConfig(8, "cpu", 32)
    naive = price({"data": 8}, [model], STANDARD_RULES, cfg)
    experts = price({"expert": 8}, [model], STANDARD_RULES, cfg)
    # Experts split 8 ways: their weights and moments no longer sit whole on every device.
    assert experts["memory_bytes"]["params"] < naive["memory_bytes"]["params"] / 2
    # The token exchange over the expert axis, on the critical path: dropless (tiny-moe's
    # default) on CPU, each device's 4 rows of tokens x top-k sent in a block of the receive
    # bound to each peer, forward and backward (an all-to-all; the results come back by
    # all-gather), float32, every layer, beside two int32 routing tables each forward.
    mc = get_model_config("tiny-moe")
    rows = 8 * dispatch_rows(32 // 8 * mc.seq_len, mc.num_experts, mc.top_k, 8, None)
    a2a = mc.num_layers * (2 * rows * mc.d_model * 4 + 2 * 2 * mc.num_experts * 4)
    assert experts["by_axis"]["expert all-to-all"]["bytes"] == a2a
    assert experts["by_axis"]["expert all-gather"]["bytes"] == mc.num_layers * rows * 128 * 4
    assert experts["comm_exposed_s"] > 0
    ranked = plan(model, STANDARD_RULES, cfg)["layouts"]
    assert any(r["mesh"]["expert"] > 1 for r in ranked)


def test_one_rule_says_fits_before_and_after_compiling_with_its_margin():
    """planning.fit.verdict: the README's TPU example, predicted 86.11 GiB and compiled 89.92
    GiB on a v5p (95.73 GiB a program may hold): the prediction fits within 90% of it, the
    compiled peak, XLA's own, within all of it; each line states the figures and the margin."""
    from jaxdist.hardware import get_hardware
    from jaxdist.planning import fit

    hw = get_hardware("v5p-128")
    gib = 2**30
    predicted = fit.verdict(86.11 * gib, hw.memory_bytes, hw.platform)
    compiled = fit.verdict(89.92 * gib, hw.memory_bytes, hw.platform, predicted=False)
    assert predicted.budget == compiled.budget == hw.memory_bytes  # a TPU's: all its HBM
    assert predicted.fits and compiled.fits
    assert predicted.line() == (
        "fits: predicted peak 86.11 GiB of 86.16 GiB usable (95.73 GiB less 10% for the "
        "prediction's error)"
    )
    assert compiled.line() == (
        "fits: compiled peak 89.92 GiB of 95.73 GiB usable (no margin: XLA's own peak)"
    )
    # Past the margin a prediction does not fit, where the same compiled peak would.
    assert not fit.verdict(89.92 * gib, hw.memory_bytes, hw.platform).fits
    assert fit.fits(89.92 * gib, hw.memory_bytes, hw.platform, predicted=False)
    # A GPU keeps 10% of the device from XLA's allocator before the rule's margin.
    h100 = get_hardware("h100")
    assert fit.verdict(0, h100.memory_bytes, "gpu").budget == pytest.approx(0.9 * h100.memory_bytes)
    assert fit.usable(h100.memory_bytes, "gpu") == pytest.approx(0.81 * h100.memory_bytes)
