"""Expert parallelism: tokens travel to their experts and back by all-to-all.

`moe_ffn` runs per device (`shard_map`): each device sends its own tokens to the devices that
hold their experts over the `expert` mesh axes, the experts run (SwiGLU; their MLP width split
Megatron-style over the `mlp` axes, their weights gathered over the FSDP axes), and a second
exchange brings the results home, where they are weighted by the router and summed.

Two ways, by `capacity_factor`:
- None, dropless (jaxdist.parallel.dropless): the tokens sorted by expert, buffers sized by the
  tokens routed, grouped GEMMs; with expert parallelism a receive buffer of a stated bound.
- a factor, capacity: each device packs its tokens into per-expert buffers of `capacity`
  slots, filled or not, the experts run as einsums over them; a token whose expert is full is
  dropped (its expert output is zero; the residual carries it on).

Pays in communication: 2 exchanges per MoE layer forward and 2 backward, each of
`dispatch_rows` x D per device; small routing messages are latency-bound.
"""

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdist.kernels import grouped_gemm
from jaxdist.layout import ways
from jaxdist.parallel import dropless
from jaxdist.rules import active

# Dropless with expert parallelism: each device's receive buffer, as a multiple of its
# balanced share of the routed rows (jaxdist.parallel.dropless; rows past it are dropped and
# counted).
BUFFER_FACTOR = 1.25


def capacity(tokens_per_device: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert in each device's send buffer (capacity mode)."""
    return max(1, math.ceil(capacity_factor * tokens_per_device * top_k / num_experts))


def dispatch_rows(
    tokens_per_device: int,
    num_experts: int,
    top_k: int,
    n_ep: int,
    capacity_factor: float | None,
    buffer_factor: float = BUFFER_FACTOR,
) -> int:
    """Rows of one device's expert buffer, the rows its experts multiply and (with n_ep > 1)
    the rows each exchange moves: E x capacity in capacity mode, the routed assignments
    (times the bound factor with expert parallelism) dropless."""
    if capacity_factor is None:
        return dropless.receive_rows(tokens_per_device, top_k, n_ep, buffer_factor)
    return num_experts * capacity(tokens_per_device, num_experts, top_k, capacity_factor)


class _Routing(NamedTuple):
    """How one device's tokens reach the experts, fixed for the layer (inside the shard_map)."""

    E: int  # all experts
    K: int  # experts per token
    C: int  # slots per expert in each device's buffer; dropless: its receive rows
    dropless: bool
    ragged: bool  # dropless exchange by ragged all-to-all (TPU, GPU)
    gemm: str  # dropless grouped GEMM: xla (ragged dot) or pallas (jaxdist.kernels.grouped_gemm)
    n_ep: int  # devices over the expert axes
    expert: tuple[str, ...]  # the mesh axes the experts are split over (all-to-all)
    embed: tuple[str, ...]  # the FSDP axes the expert weights are gathered over here
    mlp: tuple[str, ...]  # the axes the experts' MLP width is split over (partial sums)
    batch: tuple[str, ...]  # the batch and sequence axes the stats are summed over


def _swiglu(recv_sECD, up_eDF, gate_eDF, down_eFD):
    """The experts' SwiGLU on the tokens they received (a partial sum over split MLP width)."""
    h_sECF = jax.nn.silu(jnp.einsum("secd,edf->secf", recv_sECD, gate_eDF)) * jnp.einsum(
        "secd,edf->secf", recv_sECD, up_eDF
    )
    return jnp.einsum("secf,efd->secd", h_sECF, down_eFD)


def _local(r: _Routing, x_btD, e_btK, g_btK, up_eDF, gate_eDF, down_eFD):
    """One device's share, its expert weights whole over D; stats summed over the batch."""
    if r.embed:
        up_eDF = jax.lax.all_gather(up_eDF, r.embed, axis=1, tiled=True)
        gate_eDF = jax.lax.all_gather(gate_eDF, r.embed, axis=1, tiled=True)
        down_eFD = jax.lax.all_gather(down_eFD, r.embed, axis=2, tiled=True)
    b, t, D = x_btD.shape
    if r.dropless:
        y_nD, dropped, load_E = dropless.local(
            x_btD.reshape(b * t, D),
            e_btK.reshape(b * t, r.K),
            g_btK.reshape(b * t, r.K),
            (up_eDF, gate_eDF, down_eFD),
            n_ep=r.n_ep,
            R=r.C,
            expert=r.expert,
            mlp=r.mlp,
            ragged=r.ragged,
            gemm=r.gemm,
        )
    else:
        y_nD, dropped, load_E = _capacity(r, x_btD, e_btK, g_btK, up_eDF, gate_eDF, down_eFD)
    stats = {
        "dropped": dropped.astype(jnp.float32),
        "assigned": jnp.float32(b * t * r.K),
        "load_E": load_E.astype(jnp.float32),
    }
    if r.batch:
        stats = jax.lax.psum(stats, r.batch)
    return y_nD.reshape(b, t, D), stats


def _capacity(r: _Routing, x_btD, e_btK, g_btK, up_eDF, gate_eDF, down_eFD):
    """Capacity mode: pack the tokens per expert, send them, run the experts held here, bring
    the results back and weight them by the router. Returns (y_nD, dropped, load_E)."""
    E, K, C = r.E, r.K, r.C
    b, t, D = x_btD.shape
    n = b * t
    x_nD = x_btD.reshape(n, D)
    # Assignments ordered choice-major: every token's first choice claims a slot before
    # any second choice does (Switch/GShard priority).
    e_a = e_btK.reshape(n, K).T.reshape(-1)
    g_a = g_btK.reshape(n, K).T.reshape(-1)
    token_a = jnp.tile(jnp.arange(n), K)
    onehot_aE = jax.nn.one_hot(e_a, E, dtype=jnp.int32)
    pos_a = jnp.sum((jnp.cumsum(onehot_aE, axis=0) - 1) * onehot_aE, axis=1)
    keep_a = pos_a < C
    slot_a = jnp.where(keep_a, e_a * C + pos_a, E * C)  # dropped: a spare slot
    buf = jnp.zeros((E * C + 1, D), x_nD.dtype).at[slot_a].add(x_nD[token_a])
    send_sECD = buf[: E * C].reshape(r.n_ep, E // r.n_ep, C, D)
    recv_sECD = jax.lax.all_to_all(send_sECD, r.expert, 0, 0, tiled=True) if r.expert else send_sECD
    out_sECD = _swiglu(recv_sECD, up_eDF, gate_eDF, down_eFD)
    if r.mlp:
        out_sECD = jax.lax.psum(out_sECD, r.mlp)
    back_sECD = jax.lax.all_to_all(out_sECD, r.expert, 0, 0, tiled=True) if r.expert else out_sECD
    back = jnp.concatenate([back_sECD.reshape(E * C, D), jnp.zeros((1, D), x_nD.dtype)])
    y_aD = back[slot_a] * (g_a * keep_a)[:, None].astype(x_nD.dtype)
    return y_aD.reshape(K, n, D).sum(0), jnp.sum(~keep_a), jnp.sum(onehot_aE, axis=0)


def moe_ffn(
    x_BTD,
    expert_BTK,
    weight_BTK,
    w_up_EDF,
    w_gate_EDF,
    w_down_EFD,
    capacity_factor: float | None,
    buffer_factor: float = BUFFER_FACTOR,
    gemm: str = "auto",
):
    """Returns (y_BTD, stats) with stats = {dropped, assigned, load_E} summed over devices.
    `capacity_factor` None: dropless, with a receive buffer of `buffer_factor` x the balanced
    share where the experts are split over devices (rows past it dropped and counted)."""
    rules, mesh = active()
    # Axes already manual here (inside the pipeline's shard_map: `pipeline` and the batch axes)
    # hold local tokens and local expert weights, gathered over FSDP by the pipeline.
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)

    def used(axes):  # collectives over size-1 axes move nothing; leave them out
        return tuple(a for a in axes if mesh.shape[a] > 1)

    def free(axes):  # the axes this shard_map makes manual
        return tuple(a for a in axes if a not in manual)

    batch = rules.mesh_axes("batch", "activation")
    # A context split holds different tokens of the same rows: each device routes its own
    # (the experts see tokens, not rows), so the sequence stays split through the layer.
    seq = rules.mesh_axes("seq", "activation")
    expert = used(rules.mesh_axes("expert", "param"))
    embed = used(free(rules.mesh_axes("embed", "param")))  # FSDP: gathered here, where used
    mlp = used(rules.mesh_axes("mlp", "param"))
    # All experts (the weights given are this device's only where `expert` is manual).
    E = w_up_EDF.shape[0] * math.prod(mesh.shape[a] for a in expert if a in manual)
    n_ep = ways(mesh.shape, expert)
    B, T, _ = x_BTD.shape
    tokens = B // ways(mesh.shape, free(batch)) * (T // ways(mesh.shape, free(seq)))
    K = expert_BTK.shape[-1]
    if capacity_factor is None:
        C = dropless.receive_rows(tokens, K, n_ep, buffer_factor)
    else:
        C = capacity(tokens, E, K, capacity_factor)
    # XLA:CPU has no ragged all-to-all: there the dropless exchange takes padded blocks.
    ragged = mesh.devices.flat[0].platform in dropless.RAGGED_PLATFORMS
    kernel = grouped_gemm.kernel_for(gemm, mesh.devices.flat[0])
    tok = P(free(batch) or None, free(seq) or None, None)
    w_in = P(free(expert) or None, embed or None, free(mlp) or None)
    w_out = P(free(expert) or None, free(mlp) or None, embed or None)
    routing = _Routing(
        E,
        K,
        C,
        capacity_factor is None,
        ragged,
        kernel,
        n_ep,
        expert,
        embed,
        mlp,
        used(batch + seq),
    )
    stats_spec = {"dropped": P(), "assigned": P(), "load_E": P()}
    where = {"axis_names": set(free(mesh.axis_names))} if manual else {"mesh": mesh}
    return jax.shard_map(
        partial(_local, routing),
        in_specs=(tok, tok, tok, w_in, w_in, w_out),
        out_specs=(tok, stats_spec),
        check_vma=False,
        **where,
    )(x_BTD, expert_BTK, weight_BTK, w_up_EDF, w_gate_EDF, w_down_EFD)
