"""Compiling for H100 and H200 GPUs from this CPU host (jaxdist.compiled.gpu): XLA's GPU
compiler, with the target configs of the real cards, gives the optimized GPU program and its
memory. The compiles skip, saying why, where the gpu-aot extra is not installed; what a user
without it is told is tested in tests/test_extras.py."""

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxdist.compiled import gpu
from jaxdist.compiled.gemms import analyze
from jaxdist.errors import ConfigError
from tests.extras import needs_gpu_aot
from tests.helpers import cli

GIB = 2**30


def test_gpu_targets_parse_and_bad_ones_say_how():
    assert gpu.parse_target("h200:1") == gpu.GpuTarget("h200", 1, 1)
    assert gpu.parse_target("h100:8") == gpu.GpuTarget("h100", 1, 8)
    t = gpu.parse_target("h100:2x8")
    assert (t.hosts, t.per_host, t.devices, t.topology) == (2, 8, 16, "1x2x8")
    for bad in ("h100", "h100:9", "h100:0", "a100:8", "h100:2x"):
        with pytest.raises(ConfigError, match="h100:N"):
            gpu.parse_target(bad)


def test_kernel_census_reads_dtypes_per_computation():
    # The same parameter name in two computations, with different dtypes: each dot's operands
    # are looked up in its own computation. cuDNN's attention is a GEMM of the census too.
    text = """
%fused_a (p0: bf16[4,8], p1: bf16[8,2]) -> bf16[4,2] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = bf16[8,2]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}
}
%fused_b (p0: f32[4,8], p1: f32[8,2]) -> f32[4,2] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,2]{1,0} parameter(1)
  ROOT %dot.2 = f32[4,2]{1,0} dot(%p0, %p1), metadata={op_name="jit(f)/router"}
}
ENTRY %main (a: f32[4,8]) -> f32[4,2] {
  %x = bf16[1,4,8]{2,1,0} parameter(0)
  %f.1 = bf16[4,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_a
  %cc = (bf16[1,4,2], f32[1,4]) custom-call(%x), custom_call_target="__cudnn$fmhaSoftmax"
  %h = f32[4] custom-call(%y), custom_call_target="MoveToHost"
  ROOT %f.2 = f32[4,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_b
}
"""
    read = analyze(text)
    g, k = read["gemms"], read["kernels"]
    assert g["by_precision"] == {"bf16": 2, "f32": 1}
    assert g["by_kind"] == {"dot": {"bf16": 1, "f32": 1}, "cudnn": {"bf16": 1}}
    assert g["not_16bit"] == {"router": 1}
    assert k["attention"]["cudnn_fused_forward"] == 1
    assert k["attention"]["cudnn_fused_backward"] == 0
    assert (k["fusions"], k["custom_calls"], k["host_transfers"]) == (2, 2, 1)
    # fp32 attention scores [B, N, T, T] are found; a [D, D] weight or bf16 activations
    # [L, B, T, D] with D = T are not.
    scores = """ENTRY %main (a: bf16[64,64]) -> f32[2,4,64,64] {
  %w = bf16[64,64]{1,0} parameter(0)
  %x = bf16[2,4,64,64]{3,2,1,0} fusion(%w), kind=kLoop, calls=%g
  ROOT %s = f32[2,4,64,64]{3,2,1,0} fusion(%w), kind=kLoop, calls=%f
}"""
    assert analyze(scores, 64)["kernels"]["score_tensors"] == 1
    assert analyze(scores, 32)["kernels"]["score_tensors"] == 0


# Each compile is one `jaxdist` process (the compiler's flags are set before JAX starts), and
# XLA's GPU compiler keeps about one core busy: the compiles that this module's selected tests
# need all start at its first one, two at a time, and each test waits for its own.
COMPILERS = 2


def _train(*args: str) -> tuple[str, ...]:
    return ("train", *args, "--compile-only", "--json", "-")


def _plan(args: tuple[str, ...], verify: int) -> tuple[str, ...]:
    base = ("plan", "--model", "1b", "--devices", "16", "--hardware", "h100-ib")
    return (*base, *args, "--verify", str(verify))


def _preset(model: str, target: str, batch: int, mesh: str) -> tuple[str, ...]:
    """A preset's compile, the one command both the module's start and its test name (two
    spellings of it once compiled each preset twice). The presets' remat "dots", as the
    torch.compile peer's memory was measured with it (--remat auto would keep everything where
    it fits, and hold more)."""
    args = ("--model", model, "--target", target, "--batch-size", str(batch), "--remat", "dots")
    return _train(*args, "--mesh", mesh)


TWO_HOSTS = _train("--model", "tiny", "--target", "h100:2x8", "--mesh", "data=2,fsdp=8")
FP32 = _train("--model", "tiny", "--target", "h200:1", "--compute-dtype", "float32")


def _command(item) -> tuple[str, ...] | None:
    """The command a selected test of this module waits for; None: it compiles nothing."""
    callspec = getattr(item, "callspec", None)
    p = callspec.params if callspec else {}
    name = getattr(item, "originalname", item.name)
    if name == "test_preset_compiles_for_gpu_with_fused_attention_in_memory":
        return _preset(p["model"], p["target"], p["batch"], p["mesh"])
    if name == "test_planner_agrees_with_the_gpu_compiler":
        return _plan(p["args"], p["verify"])
    if name == "test_two_hosts_put_data_across_hosts_and_fsdp_inside":
        return TWO_HOSTS
    if name == "test_report_flags_fp32_matmuls_and_unfused_attention":
        return FP32
    return None


@pytest.fixture(scope="module")
def compiles(request, tmp_path_factory):
    """`compiles(command)`: its finished process and its --json file (plans), once per module."""
    mine = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    commands = list(dict.fromkeys(c for c in map(_command, mine) if c))
    commands.sort(key=lambda c: c[0] != "plan")  # the longest first: the plans
    out = tmp_path_factory.mktemp("gpu_aot")
    pool = ThreadPoolExecutor(COMPILERS)
    started = {}

    def run(command: tuple[str, ...]):
        path = out / f"plan{len(started)}.json"
        extra = ("--json", str(path)) if command[0] == "plan" else ()
        started[command] = pool.submit(cli, *command, *extra, timeout=1200), path

    for command in commands:
        run(command)

    def finished(command: tuple[str, ...]):
        if command not in started:  # a test _command does not know: run it now
            run(command)
        future, path = started[command]
        r = future.result()
        assert r.returncode == 0, r.stderr[-3000:]
        return r, path

    yield finished
    pool.shutdown(cancel_futures=True)


def _report(compiles, command: tuple[str, ...]) -> dict:
    r, _ = compiles(command)
    return json.loads(r.stdout.strip().splitlines()[-1])


# The peers' measured peaks on one H200 (the torch.compile peer, shared notes): the presets'
# defaults must fit in them.
PEER_PEAK_GIB = {("gpt2-124m", 32): 15.6, ("1b", 8): 33.1}
# The same checks on every preset and both GPUs, with `-m experiment` (48-84 s each of the
# suite's time on CI's two cores). The suite holds parts of them on tiny models: data and fsdp
# across two hosts of H100s (below), the report's warnings (fp32 matmuls and unfused attention
# compiled: FP32, -m experiment), cuDNN's fused attention on H100s (tests/test_context.py),
# MoE's Pallas experts (tests/test_grouped_gemm.py).
_SWEEP = pytest.mark.experiment
CASES = [
    pytest.param("gpt2-124m", "h200:1", 32, "auto", marks=_SWEEP),
    pytest.param("llama-124m", "h200:1", 32, "auto", marks=_SWEEP),
    pytest.param("1b", "h200:1", 8, "auto", marks=_SWEEP),
    pytest.param("moe-1b", "h200:1", 8, "auto", marks=_SWEEP),
    pytest.param("gpt2-124m", "h100:8", 32, "fsdp=8", marks=_SWEEP),
    pytest.param("1b", "h100:8", 64, "fsdp=8", marks=_SWEEP),
    pytest.param("moe-1b", "h100:8", 16, "fsdp=8", marks=_SWEEP),
    pytest.param("llama-124m", "h100:8", 32, "fsdp=8", marks=_SWEEP),
]


@pytest.mark.slow
@needs_gpu_aot
@pytest.mark.parametrize(("model", "target", "batch", "mesh"), CASES)
def test_preset_compiles_for_gpu_with_fused_attention_in_memory(
    compiles, model, target, batch, mesh
):
    r = _report(compiles, _preset(model, target, batch, mesh))
    assert r["platform"] == "gpu" and target[:4].upper() in r["device_kind"]
    k = r["kernels"]
    # cuDNN's fused attention, forward and backward; remat "dots" keeps its output, so the
    # forward kernel is not run again in the backward loop (which XLA may peel or unroll, so
    # the backward kernel can appear more than once).
    a = k["attention"]
    assert 1 <= a["cudnn_fused_forward"] <= a["cudnn_fused_backward"]
    assert a["tpu_custom_calls"] == 0
    assert r["attention_kernel"] == "cudnn fused (forward and backward)"
    assert k["score_tensors"] == 0  # no [B, N, T, T] scores anywhere in the program
    # Every matmul on bf16 operands (the loss's fp32 logits come out of a bf16 matmul), but
    # MoE's router, fp32 on purpose (models/moe.py: its softmax decides where every token
    # goes; [D, 8] weights, a sliver of the FLOPs): forward, and its backward products.
    g = r["gemms"]
    wide = [label for label in g["not_16bit"] if "btd,de->bte" not in label]
    assert wide == [], wide
    assert bool(g["not_16bit"]) == model.startswith("moe")
    # No FP8 (--fp8 off), bf16 but the router, cuDNN's attention counted once per call.
    assert set(g["by_precision"]) == ({"bf16", "f32"} if model.startswith("moe") else {"bf16"})
    fused = a["cudnn_fused_forward"] + a["cudnn_fused_backward"]
    assert g["by_kind"]["cudnn"] == {"bf16": fused}
    assert k["host_transfers"] == 0
    if model.startswith("moe"):
        _assert_experts_run_at_the_routed_flops(r, model, batch)
    # XLA's GPU target config's memory (84.9 GB on an H100), 90% of it a program's budget.
    budget = 0.9 * r["device_memory_bytes"]
    assert r["fits"] and r["per_device_bytes"]["peak_estimate"] <= budget
    assert [w for w in r["warnings"] if "32-bit operands" not in w] == []
    peer = PEER_PEAK_GIB.get((model, batch))
    if peer and target == "h200:1":
        assert r["per_device_bytes"]["peak_estimate"] / GIB <= peer
    if mesh != "auto":
        assert {c["axis"] for c in r["collectives"]} == {"fsdp"}


def _assert_experts_run_at_the_routed_flops(r: dict, model: str, batch: int) -> None:
    """The experts' grouped GEMMs run as JAX's Pallas kernels (jaxdist.kernels.grouped_gemm) at
    the routed tokens' FLOPs: each row times its own expert's matrix, in the forward, the
    backward's two products and, where remat drops it, the forward again. XLA's own GPU
    lowering of a ragged dot multiplies every row by every expert's matrix (8x here)."""
    from models.presets import get_model_config

    c = get_model_config(model)
    tokens = batch * r["seq_len"] // math.prod(r["mesh"].values())
    forward = tokens * c.top_k * 3 * 2 * c.d_model * c.d_mlp * c.num_layers
    assert r["matmuls"]["ragged_dots"] in (3 * forward, 4 * forward)
    assert set(r["gemms"]["by_kind"]["pallas"]) == {"bf16"}


# 50 s of XLA's GPU compiler on CI's two cores: -m experiment, to keep the suite under 15
# minutes (tests/test_plan_fleets.py holds which axes the planner puts across hosts).
@pytest.mark.experiment
@needs_gpu_aot
def test_two_hosts_put_data_across_hosts_and_fsdp_inside(compiles):
    r = _report(compiles, TWO_HOSTS)
    assert r["axes_across_hosts"] == ["data"]
    assert {c["axis"] for c in r["collectives"]} >= {"data", "fsdp"}


def test_the_reports_warnings_name_what_would_make_the_step_slow_or_fail():
    """aot.warnings on a report as the GPU compiler's reading gives it (the compile itself:
    the next test, -m experiment)."""
    from jaxdist.compiled.aot import warnings

    report = {
        "attention_kernel": "xla (fallback: T x T scores in memory)",
        "gemms": {"not_16bit": {"router": 1, "btd,de->bte": 2}},
        "kernels": {"host_transfers": 3},
        "per_device_bytes": {"peak_estimate": 3 * 2**30},
    }
    assert warnings(report, 2 * 2**30) == [
        "attention is not fused: xla (fallback: T x T scores in memory)",
        "3 matmuls with 32-bit operands (slower than bf16 on tensor cores): see gemms.not_16bit",
        "3 host transfers inside the step",
        "peak 3.0 GiB per device is over the 2.0 GiB a program may hold on the device",
    ]
    fused = {
        **report, "attention_kernel": "cudnn fused (forward and backward)",
        "gemms": {"not_16bit": {}}, "kernels": {"host_transfers": 0},
    }  # fmt: skip
    assert warnings(fused, 4 * 2**30) == []


@pytest.mark.slow
@pytest.mark.experiment  # a GPU compile of its own, 45 s of the suite: its reading is above
@needs_gpu_aot
def test_report_flags_fp32_matmuls_and_unfused_attention(compiles):
    # fp32 compute: cuDNN's attention takes 16-bit inputs only, so XLA's runs, on fp32 dots.
    r = _report(compiles, FP32)
    assert r["attention_kernel"].startswith("xla")
    assert r["gemms"]["not_16bit"]
    assert r["gemms"]["by_precision"]["f32"] > 0
    text = " ".join(r["warnings"])
    assert "attention is not fused" in text and "32-bit operands" in text


# The bar: on 16 H100s (2 hosts), the planner's memory per GPU within 15% and its
# collective bytes within 5% of what XLA's GPU compiler makes of the three best layouts of 1b
# at batch 512, and of the three best pipelined ones (cuDNN attention inside the pipeline's
# shard_map, the head's fused loss in its forward ticks, the layers' residuals rebuilt in its
# backward ones). The suite compiles one of each kind, the best; `-m experiment` the six.
# The suite's pipelined case is one layout priced as given (`--mesh`).
PLANS = [
    pytest.param((), 1, 0, id="best"),
    pytest.param(("--mesh", "pipeline=2,fsdp=8", "--batch-size", "768"), 1, 1, id="pipelined"),
    pytest.param((), 3, 0, id="three-best", marks=pytest.mark.experiment),
    pytest.param(("--axes", "pipeline,fsdp"), 3, 2, id="three-pipelined", marks=_SWEEP),
]


@pytest.mark.slow
@needs_gpu_aot
@pytest.mark.parametrize(("args", "verify", "pipelined"), PLANS)
def test_planner_agrees_with_the_gpu_compiler(compiles, args, verify, pipelined):
    r, path = compiles(_plan(args, verify))
    rows = json.loads(path.read_text())["layouts"][:verify]
    for row in rows:
        v = row["verify"]
        assert v["platform"] == "gpu" and v["predicted_peak_bytes"] == row["memory_bytes"]["peak"]
        assert v["memory_ok"] and v["bytes_ok"], (row["layout"], v)
    compiled_pipelined = sum(row["mesh"]["pipeline"] > 1 for row in rows)
    assert compiled_pipelined >= pipelined if pipelined else compiled_pipelined == 0
    assert "FLAG" not in r.stdout
