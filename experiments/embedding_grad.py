"""The embedding table's gradient three ways, timed on one device: the step's scatter-add today,
the same in float32, and PyTorch's way (ids sorted, each row's run summed).

Why: on one H200 the gpt2-124m step's single slowest kernel is this scatter-add, 22.15 ms of
90.2 ms of kernels a step (experiments/README.md, "The H200 call"). jaxdist.kernels.lookup adds
each token's bf16 row atomically into the [V, D] table; tokens repeat (text is Zipfian), so the
adds to frequent rows contend. PyTorch's embedding_dense_backward sorts the ids first and sums
each run. Which of these the next step should use is a GPU measurement; this script is it, in
one process, every way beside the others, with p50/p90/max over repeats and each way's error
against a float64 sum on the host.

    python experiments/embedding_grad.py                   # gpt2-124m's shapes, on the GPU
    python experiments/embedding_grad.py --smoke           # small shapes, any device (CPU)

Legend: N tokens  D embed  V vocab
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def scatter_add(ids_N, g_ND, V: int):
    """What jaxdist.kernels.lookup does today: an add per token into the table, in g's dtype."""
    return jnp.zeros((V, g_ND.shape[1]), g_ND.dtype).at[ids_N].add(g_ND)


def scatter_add_f32(ids_N, g_ND, V: int):
    """The same adds in float32 (native atomics on a GPU, no bf16 rounding per add)."""
    g_VD = jnp.zeros((V, g_ND.shape[1]), jnp.float32).at[ids_N].add(g_ND.astype(jnp.float32))
    return g_VD.astype(g_ND.dtype)


def sorted_segment_sum(ids_N, g_ND, V: int):
    """PyTorch's way: ids sorted, rows gathered in that order, each run of one id summed in
    float32 (`indices_are_sorted` lets XLA sum a run before it writes)."""
    order_N = jnp.argsort(ids_N)
    g_VD = jax.ops.segment_sum(
        g_ND[order_N].astype(jnp.float32),
        ids_N[order_N],
        num_segments=V,
        indices_are_sorted=True,
    )
    return g_VD.astype(g_ND.dtype)


WAYS = {
    "scatter_add": scatter_add,
    "scatter_add_f32": scatter_add_f32,
    "sorted": sorted_segment_sum,
}


def token_ids(n: int, V: int, zipf: float | None, seed: int = 0) -> np.ndarray:
    """n ids in [0, V): Zipf-distributed like text (exponent `zipf`), or uniform if None."""
    rng = np.random.default_rng(seed)
    if zipf is None:
        return rng.integers(0, V, n).astype(np.int32)
    return ((rng.zipf(zipf, n) - 1) % V).astype(np.int32)


def timed(fn, args, repeats: int) -> dict:
    """Milliseconds per call after one warm-up (the compile), each call waited for."""
    jax.block_until_ready(fn(*args))
    ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ms.append(1e3 * (time.perf_counter() - t))
    p50, p90 = np.percentile(ms, [50, 90])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "max_ms": float(max(ms))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--tokens", type=int, default=32 * 1024, help="batch x sequence")
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="small shapes, a few repeats")
    args = ap.parse_args()
    if args.smoke:
        args.vocab, args.tokens, args.d, args.repeats = 1000, 4096, 64, 5
    V, N, D = args.vocab, args.tokens, args.d
    g_ND = jax.random.normal(jax.random.key(0), (N, D), jnp.float32).astype(args.dtype)
    g64 = np.asarray(g_ND.astype(jnp.float32), np.float64)
    report = {"device": str(jax.devices()[0].device_kind), "V": V, "N": N, "D": D, "cases": []}
    for zipf in (1.1, None):  # text-like repeats, then none to speak of
        ids_N = jnp.asarray(token_ids(N, V, zipf))
        want_VD = np.zeros((V, D))
        np.add.at(want_VD, np.asarray(ids_N), g64)
        scale = np.abs(want_VD).max()
        case = {"ids": f"zipf {zipf}" if zipf else "uniform", "ways": {}}
        for name, way in WAYS.items():
            fn = jax.jit(way, static_argnums=2)
            got = np.asarray(fn(ids_N, g_ND, V).astype(jnp.float32), np.float64)
            case["ways"][name] = timed(fn, (ids_N, g_ND, V), args.repeats) | {
                "max_error_over_max": float(np.abs(got - want_VD).max() / scale)
            }
        base = case["ways"]["scatter_add"]["p50_ms"]
        for name, row in case["ways"].items():
            row["p50_over_scatter_add"] = row["p50_ms"] / base
            ratio, err = row["p50_over_scatter_add"], row["max_error_over_max"]
            line = f"{case['ids']:9s} {name:16s} p50 {row['p50_ms']:8.3f} ms ({ratio:.2f}x)"
            print(f"{line}  error {err:.1e}")
        report["cases"].append(case)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
