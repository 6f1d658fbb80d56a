"""FP8 GEMMs in the compiled GPU program (jaxdist.compiled.gemms): a projection quantized the
direct way (flax's fp8_scaled_dot_general: a dot on f8 operands) compiles, forward and both
backward GEMMs, to GEMMs that read f8; the quantize-dequantize pattern around a bf16 dot
(flax's Fp8DotGeneralOp) and a plain bf16 dot count as 16-bit; compiled in this process for one
H100 (jaxdist.compiled.gpu) at jaxdist's compiler options. The model's own step with --fp8
(`train --compile-only --target h200:1`): every projection's GEMMs read f8, only the head's and
attention's stay 16-bit, at no more memory than bf16's. The compiles skip where the gpu-aot
extra is absent."""

import pathlib

import pytest

from jaxdist.compiled import gemms
from tests.extras import needs_gpu_aot

# [tokens, d_in] x [d_in, d_out]: a projection worth FP8 (jaxdist.kernels.fp8.worth_fp8).
X_SHAPE, W_SHAPE = (1024, 2048), (2048, 4096)
HISTORY = 16


def _step(pattern: str):
    """The loss's value and gradients through one projection of `pattern`: direct (f8
    operands), qdq (quantize-dequantize around a bf16 dot) or bf16 (a plain dot)."""
    import jax
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    dims = (((1,), (0,)), ((), ()))

    def project(x_TK, w_KN, meta):
        (x_scale, x_hist), (w_scale, w_hist), (g_scale, g_hist) = meta
        if pattern == "direct":
            return fp8_ops.fp8_scaled_dot_general(
                x_TK,
                w_KN,
                dims,
                preferred_element_type=x_TK.dtype,
                lhs_scale=x_scale,
                rhs_scale=w_scale,
                grad_scale=g_scale,
                lhs_amax_history=x_hist,
                rhs_amax_history=w_hist,
                grad_amax_history=g_hist,
                quantize_compute_type=jnp.bfloat16,
            )
        if pattern == "qdq":
            e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
            xq_TK = fp8_ops.in_qdq(jnp.bfloat16, e4m3, x_TK, x_scale, x_hist)
            wq_KN = fp8_ops.in_qdq(jnp.bfloat16, e4m3, w_KN, w_scale, w_hist)
            y_TN = fp8_ops.dot_general_with_precision(xq_TK, wq_KN, dims)
            return fp8_ops.out_qdq(jnp.bfloat16, e5m2, y_TN, g_scale, g_hist)
        return jax.lax.dot_general(x_TK, w_KN, dims)

    def loss(x_TK, w_KN, meta):
        return jnp.sum(jnp.square(project(x_TK, w_KN, meta).astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _compiled_census(pattern: str, triton: bool = True) -> dict:
    """The GEMM census of `pattern`'s step compiled for one H100 at jaxdist's options (Triton
    GEMMs on), or with Triton GEMMs off (cuBLAS calls, MaxText's check)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxdist.compiled import gpu

    device = gpu.gpu_devices(gpu.GpuTarget("h100", 1, 1))[0]
    on = SingleDeviceSharding(device)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=on)

    meta = tuple((spec((1,), jnp.float32), spec((HISTORY,), jnp.float32)) for _ in range(3))
    lowered = _step(pattern).lower(spec(X_SHAPE, jnp.bfloat16), spec(W_SHAPE, jnp.bfloat16), meta)
    options = dict(gpu.COMPILER_OPTIONS, xla_gpu_enable_triton_gemm=triton)
    return gemms.census(lowered.compile(compiler_options=options).as_text())


@needs_gpu_aot
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "cublas"])
def test_a_direct_fp8_projection_compiles_to_three_f8_gemms(triton):
    counts = _compiled_census("direct", triton)
    # Forward, data gradient and weight gradient, all on f8 operands; none in 16 bits.
    assert counts["by_precision"] == {"f8": 3}
    assert counts["by_kind"] == {"triton" if triton else "cublas": {"f8": 3}}
    assert gemms.summary(counts) == "GEMMs: 3 f8"


@needs_gpu_aot
@pytest.mark.parametrize("pattern", ["qdq", "bf16"])
def test_qdq_and_a_plain_bf16_dot_count_as_16_bit(pattern):
    # At jaxdist's options (Triton GEMMs on), XLA leaves the quantize-dequantize pattern three
    # bf16 GEMMs: the silent fallback (with Triton off it would rewrite it to cuBLAS's f8).
    counts = _compiled_census(pattern)
    assert counts["by_precision"] == {"bf16": 3}
    assert counts["by_kind"] == {"triton": {"bf16": 3}}


# One program with each kind of GEMM XLA writes (trimmed from compiled H100 programs).
PROGRAM = (pathlib.Path(__file__).parent / "fixtures" / "gemm_kinds.hlo.txt").read_text()


def test_census_reads_each_kind_of_gemm_by_its_operands():
    found = {g.name: g for g in gemms.gemms(PROGRAM)}
    assert {n: (g.kind, g.precision) for n, g in found.items()} == {
        "dot.1": ("triton", "f8"),
        # An f8 operand beside a bf16 one: a 16-bit GEMM.
        "dot.2": ("triton", "bf16"),
        "dot.3": ("dot", "f32"),
        "cublas-gemm.1": ("cublas", "f8"),
        # A tuple's element read by index (%t#1).
        "cublas-gemm.2": ("cublas", "bf16"),
        "fmha": ("cudnn", "bf16"),
    }
    assert (found["dot.1"].label, found["dot.1"].backward) == ("btd,df->btf", True)
    assert found["dot.2"].label == "sbtd,dv->sbtv"
    assert found["dot.3"].label == "router"
    assert (found["fmha"].label, found["fmha"].backward) == ("attention (cuDNN)", True)
    counts = gemms.census(PROGRAM)
    assert counts["by_precision"] == {"f8": 2, "bf16": 3, "f32": 1}
    assert counts["by_kind"]["triton"] == {"f8": 1, "bf16": 1}
    assert gemms.summary(counts, labels=2) == (
        "GEMMs: 2 f8, 3 bf16, 1 f32 (not f8: sbtd,dv->sbtv, router, ...)"
    )


def test_compile_report_shows_the_census_under_its_memory():
    from rich.console import Console

    from jaxdist.cli.compile_report import print_report

    gib = 2**30
    report = {
        "model": "tiny",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "mesh": {"fsdp": 8},
        "batch_size": 16,
        "seq_len": 128,
        "remat": "none",
        "per_device_bytes": {"peak_estimate": gib},
        "predicted_peak_bytes": gib,
        "collectives": [],
        "gemms": gemms.census(PROGRAM),
    }
    console = Console(width=100, record=True)
    print_report(report, console)
    text = console.export_text()
    assert "GEMMs: 2 f8, 3 bf16, 1 f32 (not f8: sbtd,dv->sbtv, router" in text
    assert text.index("compiled peak") < text.index("GEMMs:") < text.index("collectives")


# --- The model's own step, compiled for one H200 --------------------------------------------

# Two Llama-style layers whose five projections all pass worth_fp8 (d 2048, d_mlp 5632: every
# GEMM reads or writes more than 1,024 features), a 32K vocabulary; small enough to compile in
# about 25 s here (remat dots, as the presets).
SMALL_LLAMA = (
    *("--model", "custom", "--style", "llama", "--layers", "2", "--d-model", "2048"),
    *("--heads", "16", "--kv-heads", "8", "--d-mlp", "5632", "--vocab", "32000"),
    *("--seq-len", "512", "--batch-size", "4", "--remat", "dots"),
)
RECIPES = ["off", "current", pytest.param("delayed", marks=pytest.mark.experiment)]


def _selected_recipes(request) -> list[str]:
    """The recipes this session's selected model-level tests compile (off always: the
    baseline), so that they start at once, side by side."""
    mine = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    wanted = {
        i.callspec.params["recipe"]
        for i in mine
        if getattr(i, "originalname", "") == "test_the_models_projections_compile_to_f8_gemms"
    }
    return ["off", *sorted(wanted - {"off"})] if wanted else []


@pytest.fixture(scope="module")
def model_reports(request):
    """recipe -> the compile report (--json) of SMALL_LLAMA's step for one H200, each
    compile its own `jaxdist train --compile-only` process, all started at once."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers import cli

    def compile_(recipe: str) -> dict:
        args = ("train", *SMALL_LLAMA, "--fp8", recipe, "--target", "h200:1")
        r = cli(*args, "--compile-only", "--json", "-", timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    recipes = _selected_recipes(request)
    with ThreadPoolExecutor(len(recipes) or 1) as pool:
        futures = {r: pool.submit(compile_, r) for r in recipes}
        return {r: f.result() for r, f in futures.items()}


def _head_or_attention(gemm: dict) -> bool:
    """The GEMMs --fp8 leaves in the compute dtype: the head's (the fused loss's einsums over
    the vocabulary, v) and cuDNN's fused attention."""
    head = "->" in gemm["label"] and "v" in gemm["label"]
    return head or gemm["label"] == "attention (cuDNN)"


@pytest.mark.slow
@needs_gpu_aot
@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "off"])
def test_the_models_projections_compile_to_f8_gemms(model_reports, recipe):
    off, fp8 = model_reports["off"], model_reports[recipe]
    each = fp8["gemms"]["each"]
    # Nothing but the head and attention in 16 bits: a projection that fell back fails here.
    wide = [g for g in each if g["precision"] != "f8" and not _head_or_attention(g)]
    assert wide == [], wide
    assert {g["precision"] for g in each if _head_or_attention(g)} == {"bf16"}
    # Forward GEMMs on e4m3 x e4m3; both backward ones read the output gradient in e5m2.
    forward = [g for g in each if g["precision"] == "f8" and not g["backward"]]
    backward = [g for g in each if g["precision"] == "f8" and g["backward"]]
    assert all(g["operands"] == ["f8e4m3fn", "f8e4m3fn"] for g in forward), forward
    assert all("f8e5m2" in g["operands"] for g in backward), backward
    # Five projections (q/k/v, out, up, gate, down) x (forward, dgrad, wgrad) = 15 GEMMs, less
    # those XLA merges: up and gate read the same input (current: 13, their forward and wgrad
    # merged; delayed: 15, each tensor's own scale keeps them apart).
    assert len(forward) >= 4 and len(backward) >= 8 and len(each) - len(forward + backward) == 5
    # The same step in bf16: its projections 16-bit, none f8.
    assert "f8" not in off["gemms"]["by_precision"]
    # FP8 holds no more memory than bf16, within 5%.
    peak, bf16_peak = (r["per_device_bytes"]["peak_estimate"] for r in (fp8, off))
    assert peak <= 1.05 * bf16_peak, (peak / 2**30, bf16_peak / 2**30)
