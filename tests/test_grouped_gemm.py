"""The experts' grouped GEMM on Hopper (jaxdist.kernels.grouped_gemm): the custom VJP that joins
JAX's two Mosaic GPU kernels gives `jax.lax.ragged_dot`'s values and gradients.

The kernels themselves run only on a Hopper GPU; JAX tests them there. What can go wrong on our
side is the wiring: which kernel computes which product, the transposed read of the weights for
the input gradient, the rows the kernels leave unwritten past the groups' sum. Here the kernels
are replaced by stand-ins that keep their contracts (the signatures and shapes of
`ragged_dot_mgpu.ragged_dot` and `transposed_ragged_dot_mgpu.transposed_ragged_dot`) and write
NaN into the rows they leave unwritten, so a missing mask shows."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.errors import ConfigError
from jaxdist.kernels import grouped_gemm
from models.presets import get_model_config
from tests.extras import needs_gpu_aot
from tests.helpers import cli

R, K, N, G = 512, 128, 256, 4


def _forward_stand_in(lhs, rhs, *, group_sizes, transpose_rhs=False):
    """ragged_dot_mgpu.ragged_dot's contract: lhs [M, k], rhs [G, k, n] ([G, n, k] read
    transposed); rows past the groups' sum are left as they were (NaN here)."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    y = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    rows = jnp.arange(lhs.shape[0])[:, None]
    return jnp.where(rows < group_sizes.sum(), y, jnp.nan).astype(lhs.dtype)


def _weights_stand_in(lhs, rhs, *, group_sizes):
    """transposed_ragged_dot_mgpu.transposed_ragged_dot's contract: lhs [k, m], rhs [k, n], k
    ragged: [G, m, n], each group's lhs^T rhs over its rows (JAX's own reference for it)."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers=dims)
    return out.astype(lhs.dtype)


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(grouped_gemm, "KERNELS", lambda: (_forward_stand_in, _weights_stand_in))


def _inputs():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(R, K)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(G, K, N)) / np.sqrt(K), jnp.bfloat16)
    # Uneven groups, one empty, and a tail of 100 rows in no group (a receive buffer's unused
    # rows): they must come out zero and carry no gradient.
    sizes = jnp.asarray([150, 0, 200, 62], jnp.int32)
    return x, w, sizes


def test_pallas_wiring_equals_ragged_dot_values_and_gradients(stand_ins):
    x, w, sizes = _inputs()
    assert int(sizes.sum()) < R

    def loss(kernel, x, w):
        y = grouped_gemm.grouped_matmul(x, w, sizes, kernel)
        # A loss that weights rows differently, so a gradient routed to the wrong row shows.
        return jnp.sum(y.astype(jnp.float32) * jnp.linspace(-1, 1, N)[None, :]), y

    (l_xla, y_xla), g_xla = jax.value_and_grad(loss, (1, 2), has_aux=True)("xla", x, w)
    (l_pal, y_pal), g_pal = jax.value_and_grad(loss, (1, 2), has_aux=True)("pallas", x, w)
    assert not jnp.isnan(y_pal).any()
    np.testing.assert_array_equal(np.asarray(y_pal[int(sizes.sum()) :], np.float32), 0)
    np.testing.assert_allclose(np.float32(l_pal), np.float32(l_xla), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y_pal, np.float32), np.asarray(y_xla, np.float32))
    for a, b, name in zip(g_pal, g_xla, ("dx", "dw"), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert not jnp.isnan(a).any(), name
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2
        )
    # The rows in no group get no gradient.
    np.testing.assert_array_equal(np.asarray(g_pal[0][int(sizes.sum()) :], np.float32), 0)


def test_shapes_the_kernels_do_not_take_fall_back_to_ragged_dot(stand_ins, monkeypatch):
    """float32, or widths off the kernels' tiles: XLA's ragged dot (the stand-ins never run)."""
    monkeypatch.setattr(grouped_gemm, "KERNELS", lambda: pytest.fail("kernel used"))
    x, w, sizes = _inputs()
    y = grouped_gemm.grouped_matmul(x.astype(jnp.float32), w, sizes, "pallas")
    assert y.shape == (R, N)
    y = grouped_gemm.grouped_matmul(x[:, :96], w[:, :96], sizes, "pallas")
    assert y.shape == (R, N)


def test_the_kernel_is_chosen_by_device_and_pallas_elsewhere_says_so():
    cpu = jax.devices("cpu")[0]
    assert grouped_gemm.kernel_for("auto", cpu) == "xla"
    assert grouped_gemm.kernel_for("xla", cpu) == "xla"

    class H100:
        platform, device_kind, compute_capability = "gpu", "NVIDIA H100 80GB HBM3", "9.0"

    class A100(H100):
        device_kind, compute_capability = "NVIDIA A100-SXM4-80GB", "8.0"

    assert grouped_gemm.kernel_for("auto", H100()) == "pallas"
    assert grouped_gemm.kernel_for("auto", A100()) == "xla"
    with pytest.raises(ConfigError) as e:
        grouped_gemm.kernel_for("pallas", A100())
    assert "\n" not in str(e.value) and "--moe-gemm auto" in str(e.value)


@needs_gpu_aot
def test_compiled_for_h100s_the_experts_run_at_the_routed_tokens_flops():
    """tiny-moe's step compiled for eight H100s from this host: its experts' grouped GEMMs are
    the Pallas kernels (the census's kind `pallas`, bf16), counted at the routed tokens' FLOPs
    in the forward, the backward's two products and, where remat drops it, the forward again.
    XLA's own lowering of the ragged dots runs every row against all 8 experts' matrices."""
    r = cli(
        "train", "--model", "tiny-moe", "--target", "h100:8", "--mesh", "fsdp=8",
        "--batch-size", "16", "--compute-dtype", "bfloat16", "--compile-only", "--json", "-",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    c = get_model_config("tiny-moe")
    tokens = 16 * report["seq_len"] // 8
    forward = tokens * c.top_k * 3 * 2 * c.d_model * c.d_mlp * c.num_layers
    assert report["matmuls"]["ragged_dots"] in (3 * forward, 4 * forward)
    assert report["gemms"]["by_kind"]["pallas"].keys() == {"bf16"}
