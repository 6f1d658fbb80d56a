"""Dropless experts: every routed token runs, in buffers sized by the tokens actually routed.

Legend: n tokens here  K choices  A = n x K assignments  D embed  F mlp  E experts
        e experts held here (E / n_ep)  s peers over the `expert` axes (n_ep)  R receive rows

Per device (inside `moe_ffn`'s shard_map): the A assignments are sorted by expert (a stable
argsort, whose inverse un-sorts them), the experts' SwiGLU runs as grouped GEMMs
(`jax.lax.ragged_dot`) over the sorted rows with per-expert group sizes, the results are
un-sorted, weighted by the router and their K choices summed. Without expert parallelism this
is exact and needs no bound: A rows.

With expert parallelism each device sends each peer the rows routed to that peer's experts,
ordered so that the receiver's buffer comes out grouped by its local expert (then by source):
one ragged all-to-all there, one back. The receive buffer has a static size,
R = receive_rows(n, K, n_ep, buffer_factor) = buffer_factor x the balanced share (n x K): a
device that is sent more keeps the first R rows in (local expert, source) order and drops the
rest: their expert output is zero (the residual carries the token on, as a capacity drop
does) and they are counted in the `dropped` statistic. The default factor 1.25 keeps the
experts' FLOPs and the exchanged bytes within 1.25x the routed tokens'; the imbalance that
matters is a device's total over its E / n_ep experts, which averages out far more than one
expert's. Raise it (`moe_buffer_factor`) where `moe_dropped` is not 0.

Backends: TPU and GPU exchange with `jax.lax.ragged_all_to_all`. XLA:CPU has no ragged
all-to-all (jax 0.11.2), so there each device sends every peer a block of R rows with its rows
at the places the ragged exchange would write them (an all-to-all; the blocks' rows are
disjoint, so their sum is the receive buffer) and gathers the results back (an all-gather):
the same rows, the same buffer, the same drops, at n_ep times the bytes.
"""

import math

import jax
import jax.numpy as jnp

from jaxdist.kernels import grouped_gemm

RAGGED_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")
# With experts split over devices, a device's tokens go through in CHUNKS equal chunks, each its
# own exchange and grouped GEMMs, so that one chunk's exchange can run under the other's GEMMs
# (where the ragged all-to-all is asynchronous: TPU, `compiler_options`). What it pays: twice
# the exchange's messages (each half the rows: latency), and a receive bound per chunk (a chunk
# averages fewer tokens' choices, so at the same factor it may drop a few more).
CHUNKS = 2


def chunks(tokens: int, n_ep: int) -> int:
    """The chunks a device's `tokens` go through in: CHUNKS with expert parallelism where they
    divide, else 1."""
    return CHUNKS if n_ep > 1 and tokens % CHUNKS == 0 else 1


def receive_rows(tokens: int, top_k: int, n_ep: int, buffer_factor: float) -> int:
    """Rows of one device's expert buffers, all its chunks': all its assignments without expert
    parallelism, else per chunk buffer_factor x the chunk's balanced share (never more than
    every peer's assignments)."""
    if n_ep == 1:
        return tokens * top_k
    c = chunks(tokens, n_ep)
    A = tokens // c * top_k
    return c * min(A * n_ep, math.ceil(buffer_factor * A))


def compiler_options(platform: str) -> dict[str, bool]:
    """The XLA options of the exchange, for jit on `platform`: on TPU, asynchronous ragged
    all-to-alls (libtpu's default is a synchronous one, under which nothing else runs)."""
    return {"xla_tpu_enable_async_ragged_all_to_all": True} if platform == "tpu" else {}


def exchanges(
    tokens: int, top_k: int, n_ep: int, buffer_factor: float, ragged: bool
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """What one layer's exchange moves over the expert axes, (forward, backward), as (kind,
    rows per device of the collective's result), for each chunk: out to the experts and back,
    and the transposes of those. Besides: two int32 [n_ep, 2, E / n_ep] routing tables each
    forward and chunk."""
    if n_ep == 1:
        return [], []
    c = chunks(tokens, n_ep)
    A, R = tokens // c * top_k, receive_rows(tokens, top_k, n_ep, buffer_factor) // c
    if ragged:
        both = [("ragged-all-to-all", R), ("ragged-all-to-all", A)] * c
        return both, both
    out = n_ep * R  # a block of R rows per peer
    forward = [("all-to-all", out), ("all-gather", out)] * c
    return forward, [("all-to-all", out), ("reduce-scatter", out)] * c


def swiglu(x_RD, sizes_e, up_eDF, gate_eDF, down_eFD, gemm: str = "xla"):
    """The experts' SwiGLU as grouped GEMMs (jaxdist.kernels.grouped_gemm, `gemm` its kernel):
    rows grouped by expert, sizes_e rows each (rows past their sum come out zero)."""
    gate_RF = grouped_gemm.grouped_matmul(x_RD, gate_eDF, sizes_e, gemm)
    up_RF = grouped_gemm.grouped_matmul(x_RD, up_eDF, sizes_e, gemm)
    return grouped_gemm.grouped_matmul(jax.nn.silu(gate_RF) * up_RF, down_eFD, sizes_e, gemm)


def _plan(counts_E, in_off_E, n_ep, R, expert):
    """Who sends what where. Returns the sender's view (where each of its E slices lands on
    its receiver, and how many rows of it are kept) and the receiver's (per source and local
    expert: where the slice starts in its buffer, how many rows it keeps, how many it was
    sent, and where the results go back to on the source)."""
    e = counts_E.shape[0] // n_ep
    to_peer = jnp.stack([counts_E.reshape(n_ep, e), in_off_E.reshape(n_ep, e)], 1)
    got = jax.lax.all_to_all(to_peer, expert, 0, 0, tiled=True)  # [s, 2, e]
    sent_se, home_se = got[:, 0], got[:, 1]
    # The receiver's buffer: grouped by local expert, then by source.
    flat_es = sent_se.T.reshape(-1)
    off_se = (jnp.cumsum(flat_es) - flat_es).reshape(e, n_ep).T
    kept_se = jnp.clip(R - off_se, 0, sent_se)
    back = jax.lax.all_to_all(jnp.stack([off_se, kept_se], 1), expert, 0, 0, tiled=True)
    return back[:, 0].reshape(-1), back[:, 1].reshape(-1), (off_se, kept_se, sent_se, home_se)


def _exchange_ragged(x_AD, in_off_E, out_off_E, keep_E, recv, R, expert, run):
    """Rows out to their experts' devices and the results back, by ragged all-to-all."""
    off_se, kept_se, _, home_se = recv
    A, D = x_AD.shape
    recv_RD = jax.lax.ragged_all_to_all(
        x_AD,
        jnp.zeros((R, D), x_AD.dtype),
        in_off_E,
        keep_E,
        out_off_E,
        kept_se.reshape(-1),
        axis_name=expert,
    )
    out_RD = run(recv_RD)
    return jax.lax.ragged_all_to_all(
        out_RD,
        jnp.zeros((A, D), out_RD.dtype),
        off_se.reshape(-1),
        kept_se.reshape(-1),
        home_se.reshape(-1),
        keep_E,
        axis_name=expert,
    )


def _exchange_blocks(x_AD, in_off_E, out_off_E, keep_E, e_A, n_ep, R, expert, run):
    """The same exchange where there is no ragged all-to-all: each peer gets a block of R rows
    holding this device's rows where the ragged exchange writes them."""
    A, D = x_AD.shape
    e = in_off_E.shape[0] // n_ep
    rank_A = jnp.arange(A) - in_off_E[e_A]
    kept_A = rank_A < keep_E[e_A]
    peer_A = e_A // e
    pos_A = jnp.where(kept_A, out_off_E[e_A] + rank_A, R)  # R: out of range, dropped
    send_sRD = jnp.zeros((n_ep, R, D), x_AD.dtype).at[peer_A, pos_A].set(x_AD, mode="drop")
    recv_RD = jax.lax.all_to_all(send_sRD, expert, 0, 0, tiled=True).sum(0)
    out_RD = run(recv_RD)
    out_sRD = jax.lax.all_gather(out_RD, expert, axis=0, tiled=False)
    y_AD = out_sRD.at[peer_A, pos_A].get(mode="fill", fill_value=0)
    return y_AD * kept_A[:, None].astype(y_AD.dtype)


def local(x_nD, e_nK, g_nK, weights, *, n_ep, R, expert, mlp, ragged, gemm="xla"):
    """One device's tokens through their experts, chunk by chunk (`chunks`; R: all chunks'
    receive rows). `weights`: this device's experts' (up, gate, down), whole over D; `mlp`:
    axes their width is split over (partial sums summed here). Returns (y_nD, dropped,
    counts_E)."""
    c = chunks(x_nD.shape[0], n_ep)
    if c == 1:
        return _chunk(x_nD, e_nK, g_nK, weights, n_ep, R, expert, mlp, ragged, gemm)
    # A Python loop, not a scan: the chunks are independent ops the scheduler may interleave.
    parts = [
        _chunk(x, e, g, weights, n_ep, R // c, expert, mlp, ragged, gemm)
        for x, e, g in zip(*(jnp.split(a, c) for a in (x_nD, e_nK, g_nK)), strict=True)
    ]
    y_nD = jnp.concatenate([p[0] for p in parts])
    return y_nD, sum(p[1] for p in parts), sum(p[2] for p in parts)


def _chunk(x_nD, e_nK, g_nK, weights, n_ep, R, expert, mlp, ragged, gemm):
    """`local` for one chunk of tokens, R its receive rows."""
    n, D = x_nD.shape
    K = e_nK.shape[1]
    up_eDF = weights[0]
    E = up_eDF.shape[0] * n_ep
    e_A = e_nK.reshape(-1)  # assignment a = token * K + choice
    order_A = jnp.argsort(e_A, stable=True)
    unsort_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(n * K, dtype=order_A.dtype))
    es_A = e_A[order_A]
    x_AD = x_nD[order_A // K]
    counts_E = jnp.zeros(E, jnp.int32).at[e_A].add(1)

    def run(rows_RD, sizes_e):
        out_RD = swiglu(rows_RD, sizes_e, *weights, gemm=gemm)
        return jax.lax.psum(out_RD, mlp) if mlp else out_RD

    if n_ep == 1:
        y_AD, dropped = run(x_AD, counts_E), jnp.int32(0)
    else:
        in_off_E = jnp.cumsum(counts_E) - counts_E
        out_off_E, keep_E, recv = _plan(counts_E, in_off_E, n_ep, R, expert)
        sizes_e = recv[1].sum(0)

        def run_here(rows_RD):
            return run(rows_RD, sizes_e)

        if ragged:
            y_AD = _exchange_ragged(x_AD, in_off_E, out_off_E, keep_E, recv, R, expert, run_here)
        else:
            y_AD = _exchange_blocks(
                x_AD, in_off_E, out_off_E, keep_E, es_A, n_ep, R, expert, run_here
            )
        dropped = jnp.sum(recv[2] - recv[1])
    y_nKD = y_AD[unsort_A].reshape(n, K, D)
    y_nD = jnp.einsum("nkd,nk->nd", y_nKD, g_nK.astype(y_nKD.dtype))
    return y_nD, dropped, counts_E
