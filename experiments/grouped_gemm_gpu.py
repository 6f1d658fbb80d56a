"""The experts' grouped GEMM on a Hopper GPU: JAX's Pallas kernels (jaxdist.kernels.grouped_gemm)
against XLA's own lowering of `jax.lax.ragged_dot`, on one layer of Qwen3-30B-A3B's experts.

What it checks and measures, one GPU, bf16: a SwiGLU over R = 2,048 x 8 sorted rows (a device's
2,048 tokens, top 8) and 128 experts of D 2048, F 768, with uneven groups and an
unused tail (a receive buffer's): the values and the three gradients of both kernels agree
(within bf16's rounding, relative to the largest entry), and the forward+backward time of each
(median of 20 after 3 warm-ups) and their ratio. The CPU tests hold the wiring with stand-ins of
the kernels (tests/test_grouped_gemm.py); only a GPU runs the kernels themselves.

    python experiments/grouped_gemm_gpu.py [--out FILE]   # needs a Hopper GPU (H100, H200)

Part of the prepared device call (experiments/h200.py, part "grouped GEMM").
"""

import argparse
import json
import pathlib
import statistics
import time

# XLA's lowering holds a [E, ROWS, D] product: 2,048 tokens keep it at 8.6 GB.
ROWS, D, F, E, TAIL = 2048 * 8, 2048, 768, 128, 1024


def _inputs():
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    used = ROWS - TAIL
    sizes = rng.multinomial(used, rng.dirichlet(np.full(E, 2.0))).astype(np.int32)
    x = jnp.asarray(rng.normal(size=(ROWS, D)), jnp.bfloat16)
    w = [jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.bfloat16) for s in ((E, D, F),) * 2]
    w.append(jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.bfloat16))
    return jax.device_put((x, *w, jnp.asarray(sizes)))


def _step(kernel: str):
    import jax
    import jax.numpy as jnp

    from jaxdist.parallel.dropless import swiglu

    def loss(x, up, gate, down, sizes):
        y = swiglu(x, sizes, up, gate, down, gemm=kernel)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _timed(fn, args, warm: int = 3, runs: int = 20) -> list[float]:
    import jax

    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the figures as JSON here too")
    args = ap.parse_args()
    import jax
    import numpy as np

    from jaxdist.kernels import grouped_gemm

    device = jax.devices()[0]
    if not grouped_gemm.hopper(device):
        raise SystemExit(f"needs a Hopper GPU (H100, H200); this host's device: {device}")
    inputs = _inputs()
    result: dict = {"device": device.device_kind, "rows": ROWS, "D": D, "F": F, "E": E}
    outputs = {}
    for kernel in ("pallas", "xla"):
        fn = _step(kernel)
        (_, y), grads = fn(*inputs)
        outputs[kernel] = [np.asarray(a, np.float32) for a in (y, *grads)]
        times = sorted(_timed(fn, inputs))
        result[kernel] = {"median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * times[17]}
    errors = {}
    for name, a, b in zip(("y", "dx", "dup", "dgate"), *outputs.values(), strict=True):
        errors[name] = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    result["max_error_over_max"] = errors
    # bf16 keeps 8 bits of mantissa: sums of 2048 products in two orders differ by a few ulps.
    result["agree"] = all(e < 2e-2 for e in errors.values())
    result["xla_over_pallas"] = result["xla"]["median_ms"] / result["pallas"]["median_ms"]
    print(json.dumps(result))  # one line: experiments/h200.py reads the last JSON line
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
