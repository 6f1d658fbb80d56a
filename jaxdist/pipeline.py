"""Pipeline parallelism: the layers split into stages along the `pipeline` mesh axis.

Each device runs its stage's share of the layers (`layers` is split over `pipeline`), and a
static schedule says, tick by tick, which microbatch each stage runs forward (F) or backward
(B); activations move one stage on and gradients one stage back by collective permutes at the
end of every tick. A stage keeps only its microbatches' inputs and recomputes its forward in
the backward pass, so what a schedule bounds is how many inputs wait at once:

  gpipe  all forwards, then all backwards: m inputs per stage; bubble (p-1)/(m+p-1)
  1f1b   after p-s warm-up forwards, one backward per forward: at most p inputs per stage,
         the same bubble

Pays in: the bubble (idle ticks), the recompute (one extra forward per stage), and the
point-to-point bytes (one activation forward and one gradient back per microbatch and stage).
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.rules import activation_rules, active

SCHEDULES = ("gpipe", "1f1b")


class Stages(NamedTuple):
    """A model cut into pipeline pieces (supplied by the model)."""

    weights: dict  # name -> array, as stored
    layer_keys: list[str]  # stacked per-layer weights, split over the pipeline axis
    embed: Callable  # (weights, tokens_bT) -> x_bTD
    body: Callable  # (layer weights, x_bTD) -> x_bTD
    head: Callable  # (weights, x_bTD) -> logits_bTV


@dataclasses.dataclass(frozen=True)
class Schedule:
    ops: np.ndarray  # [ticks, stages]: 0 idle, 1 forward, 2 backward
    mbs: np.ndarray  # [ticks, stages]: the microbatch of that op
    capacity: int  # inputs a stage holds at most

    @property
    def ticks(self) -> int:
        return self.ops.shape[0]

    def bubble(self) -> float:
        """Share of stage-ticks idle."""
        return float(np.mean(self.ops == 0))


def make_schedule(kind: str, stages: int, microbatches: int) -> Schedule:
    """Simulates the schedule tick by tick; a forward needs the previous stage's forward of
    the same microbatch one tick earlier, a backward the next stage's backward."""
    if kind not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {kind!r}: use one of {', '.join(SCHEDULES)}")
    p, m = stages, microbatches
    if kind == "1f1b" and m < p:
        raise ConfigError(
            f"1f1b needs at least as many microbatches as stages ({m} < {p}); "
            f"use --microbatches {p} or more"
        )
    f_done = np.full((p, m), -1)
    b_done = np.full((p, m), -1)
    next_f, next_b = [0] * p, [0] * p
    ops, mbs = [], []
    t = 0
    while min(next_b) < m:
        row_op, row_mb = [0] * p, [0] * p
        for s in range(p):
            i, j = next_f[s], next_b[s]
            can_f = i < m and (s == 0 or 0 <= f_done[s - 1, i] < t)
            can_b = (
                j < next_f[s]
                and 0 <= f_done[s, j] < t
                and (s == p - 1 or 0 <= b_done[s + 1, j] < t)
            )
            if kind == "gpipe":
                do = 1 if can_f else 2 if can_b and i == m else 0
            else:
                in_flight = i - j
                do = 2 if can_b else 1 if can_f and in_flight < p - s else 0
            if do == 1:
                f_done[s, i], next_f[s] = t, i + 1
                row_op[s], row_mb[s] = 1, i
            elif do == 2:
                b_done[s, j], next_b[s] = t, j + 1
                row_op[s], row_mb[s] = 2, j
        ops.append(row_op)
        mbs.append(row_mb)
        t += 1
        if t > 4 * (m + p) + 8:
            raise RuntimeError(f"schedule {kind} did not finish for p={p}, m={m}")
    ops_a, mbs_a = np.array(ops), np.array(mbs)
    capacity = p if kind == "1f1b" else m
    return Schedule(ops_a, mbs_a, capacity)


def permute_bytes(schedule: Schedule, activation_bytes: float) -> float:
    """Bytes each device sends per step: both permutes run every tick (idle stages send
    zeros), each carrying one microbatch's activation (forward) or its gradient (backward).
    Sending only on ticks with traffic would save up to half; not done yet."""
    return 2 * schedule.ticks * activation_bytes


def _recv_table(schedule: Schedule, op: int, shift: int) -> np.ndarray:
    """[ticks, stages]: the microbatch arriving at each stage at the start of each tick from
    the neighbour `shift` away (its op one tick earlier), or -1."""
    t, p = schedule.ops.shape
    out = np.full((t, p), -1)
    for tick in range(1, t):
        for s in range(p):
            src = s - shift
            if 0 <= src < p and schedule.ops[tick - 1, src] == op:
                out[tick, s] = schedule.mbs[tick - 1, src]
    return out


def value_and_grad(
    stages: Stages,
    tokens_BT1: jax.Array,
    loss_fn: Callable,
    scale,
    schedule: Schedule,
    microbatches: int,
    axis: str = "pipeline",
):
    """Mean loss over the microbatches and gradients for every weight, pipelined."""
    rules, mesh = active()
    p = mesh.shape[axis]
    B = tokens_BT1.shape[0]
    M = microbatches
    micro_MbT1 = tokens_BT1.reshape(B // M, M, -1).swapaxes(0, 1)
    layers = {k: stages.weights[k] for k in stages.layer_keys}
    shared = {k: v for k, v in stages.weights.items() if k not in layers}
    cap = schedule.capacity
    tables = tuple(
        jnp.asarray(a, jnp.int32)
        for a in (
            schedule.ops,
            schedule.mbs,
            _recv_table(schedule, 1, 1),
            _recv_table(schedule, 2, -1),
        )
    )
    fwd_perm = [(s, s + 1) for s in range(p - 1)]
    bwd_perm = [(s + 1, s) for s in range(p - 1)]

    def per_stage(layers, shared, micro_MbT1, ops, mbs, recv_f, recv_b):
        s = jax.lax.axis_index(axis)
        last = p - 1
        x0 = stages.embed(shared, micro_MbT1[0, :, :-1])
        zeros_x = jnp.zeros(x0.shape, x0.dtype)
        buf = jnp.zeros((cap, *x0.shape), x0.dtype)
        zero = lambda tree: jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), tree)  # noqa: E731

        def head_loss(shared, y, i):
            logits = stages.head(shared, y)
            return loss_fn(logits, micro_MbT1[i, :, 1:]) * scale / M

        def tick(carry, row):
            inbox_f, inbox_b, stash, g_layers, g_shared, loss, send_f, send_b = carry
            op, mb, rf, rb = (r[s] for r in row)
            # Arrivals from the neighbours' previous tick.
            got_f = jax.lax.ppermute(send_f, axis, fwd_perm)
            got_b = jax.lax.ppermute(send_b, axis, bwd_perm)
            inbox_f = jnp.where(rf >= 0, inbox_f.at[rf % cap].set(got_f), inbox_f)
            inbox_b = jnp.where(rb >= 0, inbox_b.at[rb % cap].set(got_b), inbox_b)

            def idle(state):
                inbox_b, stash, g_layers, g_shared, loss = state
                return inbox_b, stash, g_layers, g_shared, loss, zeros_x, zeros_x

            def forward(state):
                inbox_b, stash, g_layers, g_shared, loss = state
                first = (s == 0).astype(inbox_f.dtype)
                # Embedding and head run on every stage and are masked: a cond on the stage
                # index inside the partially manual shard_map trips XLA's sharding verifier.
                x = (
                    first * stages.embed(shared, micro_MbT1[mb, :, :-1])
                    + (1 - first) * inbox_f[mb % cap]
                )
                stash = stash.at[mb % cap].set(x)
                y = stages.body(layers, x)
                val, (gs, dy) = jax.value_and_grad(head_loss, argnums=(0, 1))(shared, y, mb)
                is_last = s == last
                inbox_b = jnp.where(is_last, inbox_b.at[mb % cap].set(dy), inbox_b)
                g_shared = jax.tree.map(lambda g, d: g + d * is_last.astype(d.dtype), g_shared, gs)
                loss = loss + val * is_last.astype(val.dtype)
                return inbox_b, stash, g_layers, g_shared, loss, y, zeros_x

            def backward(state):
                inbox_b, stash, g_layers, g_shared, loss = state
                x = stash[mb % cap]
                _, vjp = jax.vjp(stages.body, layers, x)  # recompute this stage's forward
                gl, dx = vjp(inbox_b[mb % cap])
                g_layers = jax.tree.map(jnp.add, g_layers, gl)
                _, vjp_e = jax.vjp(lambda w: stages.embed(w, micro_MbT1[mb, :, :-1]), shared)
                ge = vjp_e(dx)[0]
                g_shared = jax.tree.map(lambda g, d: g + d * (s == 0).astype(d.dtype), g_shared, ge)
                return inbox_b, stash, g_layers, g_shared, loss, zeros_x, dx

            state = (inbox_b, stash, g_layers, g_shared, loss)
            inbox_b, stash, g_layers, g_shared, loss, send_f, send_b = jax.lax.switch(
                op, (idle, forward, backward), state
            )
            return (inbox_f, inbox_b, stash, g_layers, g_shared, loss, send_f, send_b), None

        carry = (buf, buf, buf, zero(layers), zero(shared), jnp.float32(0), zeros_x, zeros_x)
        carry, _ = jax.lax.scan(tick, carry, (ops, mbs, recv_f, recv_b))
        _, _, _, g_layers, g_shared, loss, _, _ = carry
        # Shared weights got contributions on the first and last stage only.
        return jax.lax.psum(loss, axis), g_layers, jax.lax.psum(g_shared, axis)

    # XLA 0.11's SPMD partitioner aborts (spmd_partitioner_util.cc: "Check failed:
    # partition_group_list...") on the vocab-split embedding and loss inside this partially
    # manual shard_map when a batch axis and `tensor` are both in use; so inside the pipeline
    # the vocab dimension is computed whole (gathered over its mesh axes). Costs: the head's
    # matmul and logits are not split over `tensor` in pipelined runs.
    inner_rules = rules.with_activation("vocab", None)
    per_stage_with_rules = per_stage

    def per_stage(*args):  # noqa: F811 - the same function under the adjusted rules
        with activation_rules(inner_rules, mesh):
            return per_stage_with_rules(*args)

    layer_spec = {k: P(axis) for k in layers}

    shared_spec = {k: P() for k in shared}
    loss, g_layers, g_shared = jax.shard_map(
        per_stage,
        mesh=mesh,
        axis_names={axis},
        in_specs=(layer_spec, shared_spec, P(), P(), P(), P(), P()),
        out_specs=(P(), layer_spec, shared_spec),
        check_vma=False,
    )(layers, shared, micro_MbT1, *tables)
    return loss, {**g_layers, **g_shared}
