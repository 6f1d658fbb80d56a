"""Matmul FLOPs counted in a compiled program (jaxdist.compiled.gemms.matmul_flops): each dot,
TPU convolution, ragged dot and TPU kernel with a cost estimate, times the loop trips it runs
in; the experts' grouped GEMMs apart, as the program runs them."""

import pathlib

from jaxdist.compiled import gemms

PROGRAM = (pathlib.Path(__file__).parent / "fixtures" / "matmul_kinds.hlo.txt").read_text()


def test_each_kind_of_matmul_counts_as_the_math_needs_times_its_loop_trips():
    counted = gemms.matmul_flops(PROGRAM)
    trips = 3
    # Rows grouped by expert: each row meets one group's [16, 32] matrix, forward and the
    # weight gradient (ragged over the contracted rows) alike; the TPU kernel's own estimate.
    ragged = trips * (2 * 64 * 16 * 32 + 2 * 16 * 64 * 32 + 65536)
    # XLA:CPU's and the GPU compiler's form: a dense dot made from the ragged dot, counted as
    # the program runs it (here 2 x 64 x 64 x 16: every row times every group's matrix).
    dense = 2 * 64 * 64 * 16
    # The TPU's projection: g and q as windows over a padded input of 1, one kernel element
    # each per output (not 4 x 10); the weight gradient contracts a window of 4096 positions.
    projection = 2 * 2 * 4096 * 2048 * 4 * 10 * 128
    gradient = 2 * 2048 * 128 * 2 * 4096
    assert counted["ragged_dots"] == ragged + dense
    assert counted["by_op"] == {
        "ragged-dot": trips * 2 * (2 * 64 * 16 * 32),
        "custom-call": trips * 65536,
        "convolution": projection + gradient,
        "dot": dense,
    }
    assert counted["by_label"]["btd,dgqh->btgqh"] == projection
    assert counted["total"] == ragged + dense + projection + gradient


def test_a_scanned_matmul_compiled_here_counts_once_per_trip():
    import jax
    import jax.numpy as jnp

    def f(a, b):
        return jax.lax.scan(lambda c, _: (c @ b, None), a, None, length=5)[0]

    x = jnp.zeros((8, 16), jnp.float32)
    text = jax.jit(f).lower(x, jnp.zeros((16, 16))).compile().as_text()
    assert gemms.matmul_flops(text)["total"] == 5 * 2 * 8 * 16 * 16
