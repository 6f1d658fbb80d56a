"""FP8 GEMMs in the compiled GPU program (jaxdist.planning.gemms): a projection quantized the
direct way (flax's fp8_scaled_dot_general: a dot on f8 operands) compiles, forward and both
backward GEMMs, to GEMMs that read f8; the quantize-dequantize pattern around a bf16 dot
(flax's Fp8DotGeneralOp) and a plain bf16 dot count as 16-bit. Compiled in this process for one
H100 (jaxdist.planning.gpu) at jaxdist's compiler options; skips where the gpu-aot extra is
absent."""

import pathlib

import pytest

from jaxdist.planning import gemms
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

    from jaxdist.planning import gpu

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
