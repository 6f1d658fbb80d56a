"""Pipeline parallelism: the layers split into stages along the `pipeline` mesh axis.

Each device runs its stage's share of the layers (`layers` is split over `pipeline`), and a
static schedule (jaxdist.parallel.schedules: gpipe, 1f1b, interleaved) says, tick by tick, which
microbatch each stage runs forward (F) or backward (B), and with interleaving on which of its
virtual stages; activations move one chunk on and gradients one chunk back by collective
permutes at the end of every tick (around a ring when interleaved: the last stage's chunk k
feeds the first stage's chunk k+1). A stage keeps only its microbatches' inputs and recomputes
its forward in the backward pass.

Stored layout: the stacked layer weights keep the non-pipelined order (layer i at index i, the
`layers` dim split in p contiguous blocks), so checkpoints move freely between pipelined and
non-pipelined meshes. Interleaving wants stage d to hold chunks d, d+p, ... instead; the step
moves the chunks there by ring permutes inside the shard_map, and the gradients back, each step.
That costs about the stage's layer bytes each way per step (`schedules.permute_bytes`), paid
for the checkpoint layout staying one and the same.

Pays in: the bubble (idle ticks), the recompute (one extra forward per stage), and the
point-to-point bytes (one activation forward and one gradient back per microbatch and chunk).

Packed documents (`eos_id`): every stage derives the microbatch's documents from its tokens,
which every stage holds, so nothing more travels between stages.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist import documents
from jaxdist.errors import ConfigError
from jaxdist.parallel.schedules import (  # noqa: F401 - re-exported: the pipeline's public surface
    SCHEDULES,
    Schedule,
    make_schedule,
    permute_bytes,
    recv_table,
    shuffle_plan,
)
from jaxdist.rules import (
    AxisRules,
    activation_rules,
    active,
    local_elements,
    logical_axes,
    variables,
)


class Stages(NamedTuple):
    """A model cut into pipeline pieces (supplied by the model)."""

    weights: dict  # name -> array, as stored
    layer_keys: list[str]  # stacked per-layer weights, split over the pipeline axis
    embed: Callable  # (weights, tokens_bT, docs: Documents | None) -> x_bTD
    body: Callable  # (layer weights, x_bTD, docs: Documents | None) -> x_bTD
    head: Callable  # (weights, x_bTD) -> logits_bTV


def _layer_vars(abstract_params) -> list[nnx.Variable]:
    return [var for var in variables(abstract_params) if "layers" in logical_axes(var)]


def microbatch_bytes(
    batch_size: int,
    microbatches: int,
    batch_ways: int,
    seq_len: int,
    d_model: int,
    dtype_bytes: int,
) -> float:
    """One microbatch's activation on one device: what a stage stores, and sends each tick."""
    return batch_size // microbatches // batch_ways * seq_len * d_model * dtype_bytes


def send_bytes(
    schedule: Schedule,
    abstract_params,
    rules: AxisRules,
    mesh_shape: dict[str, int],
    activation_bytes: float,
) -> float:
    """Bytes each device sends over the pipeline axis per step (`jaxdist comm` checks them
    against the compiled HLO): activations and their gradients every tick, and, interleaved,
    the stage's stored layer shard moved into place and its gradients back."""
    layers = 0.0
    if schedule.virtual > 1:
        for var in _layer_vars(abstract_params):
            value = var.get_value()
            local = local_elements(value.shape, logical_axes(var), rules, mesh_shape, "param")
            layers += local * value.dtype.itemsize
    return permute_bytes(schedule, activation_bytes, layers)


def check_layers(abstract_params, schedule: Schedule) -> None:
    """Interleaving cuts the layers into stages x virtual stages equal chunks."""
    p, v = schedule.stages, schedule.virtual
    for var in _layer_vars(abstract_params):
        n = var.get_value().shape[logical_axes(var).index("layers")]
        if n % (p * v):
            fits = [w for w in range(2, n // p + 1) if n % (p * w) == 0]
            fix = f"--virtual-stages {' or '.join(map(str, fits))}" if fits else "another schedule"
            raise ConfigError(
                f"interleaved with {p} pipeline stages x {v} virtual stages cuts the layers "
                f"into {p * v} chunks, but {n} layers are not divisible by {p * v}; use {fix} "
                f"(or a layer count that is a multiple of {p * v})"
            )


def _shuffle(tree: dict, plan, s, axis: str, p: int, v: int) -> dict:
    """Moves each stage's [v, ...] layer chunks to the slots `plan` names, by ring permutes."""

    def move(w):
        out = jnp.zeros((v + 1, *w.shape[1:]), w.dtype)  # slot v: scratch for padding
        for shift, send_j, recv_k in plan:
            piece = jnp.take(w, jnp.asarray(send_j)[s], axis=0)
            if shift:
                piece = jax.lax.ppermute(piece, axis, [(d, (d + shift) % p) for d in range(p)])
            out = out.at[jnp.asarray(recv_k)[s]].set(piece)
        return out[:v]

    return jax.tree.map(move, tree)


def value_and_grad(
    stages: Stages,
    tokens_BT1: jax.Array,
    loss_fn: Callable,
    scale,
    schedule: Schedule,
    microbatches: int,
    axis: str = "pipeline",
    eos_id: int | None = None,
):
    """Mean loss over the microbatches and gradients for every weight, pipelined; with
    `eos_id`, rows are packed documents (jaxdist.documents), each seen alone."""
    rules, mesh = active()
    p, v = mesh.shape[axis], schedule.virtual
    B = tokens_BT1.shape[0]
    M = microbatches
    micro_MbT1 = tokens_BT1.reshape(B // M, M, -1).swapaxes(0, 1)
    layers = {k: stages.weights[k] for k in stages.layer_keys}
    shared = {k: w for k, w in stages.weights.items() if k not in layers}
    slots = v * schedule.capacity
    tables = tuple(
        jnp.asarray(a, jnp.int32)
        for a in (
            schedule.ops,
            schedule.mbs,
            schedule.chunks,
            schedule.slots(),
            recv_table(schedule, 1),
            recv_table(schedule, 2),
        )
    )
    # Interleaved chunks wrap around: the last stage feeds the first stage's next chunk.
    ring = v > 1
    fwd_perm = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    bwd_perm = [((s + 1) % p, s) for s in range(p if ring else p - 1)]

    def per_stage(layers, shared, micro_MbT1, ops, mbs, chunks, slot_t, recv_f, recv_b):
        s = jax.lax.axis_index(axis)
        last = p - 1
        # [v, layers per chunk, ...]: this stage's chunks in the order it runs them.
        layers = jax.tree.map(lambda w: w.reshape(v, -1, *w.shape[1:]), layers)
        if v > 1:
            layers = _shuffle(layers, shuffle_plan(p, v), s, axis, p, v)

        def inputs(i):  # microbatch i's input tokens and their documents (or None)
            tokens_bT = micro_MbT1[i, :, :-1]
            return tokens_bT, None if eos_id is None else documents.from_tokens(tokens_bT, eos_id)

        x0 = stages.embed(shared, *inputs(0))
        zeros_x = jnp.zeros(x0.shape, x0.dtype)
        buf = jnp.zeros((slots, *x0.shape), x0.dtype)
        zero = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)  # noqa: E731

        def head_loss(shared, y, i):
            logits = stages.head(shared, y)
            return loss_fn(logits, micro_MbT1[i, :, 1:]) * scale / M

        def tick(carry, row):
            inbox_f, inbox_b, stash, g_layers, g_shared, loss, send_f, send_b = carry
            op, mb, k, slot, rf, rb = (r[s] for r in row)
            # Arrivals from the neighbours' previous tick.
            got_f = jax.lax.ppermute(send_f, axis, fwd_perm)
            got_b = jax.lax.ppermute(send_b, axis, bwd_perm)
            inbox_f = jnp.where(rf >= 0, inbox_f.at[rf].set(got_f), inbox_f)
            inbox_b = jnp.where(rb >= 0, inbox_b.at[rb].set(got_b), inbox_b)
            chunk = jax.tree.map(lambda w: w[k] if v > 1 else w[0], layers)
            first = (s == 0) & (k == 0)
            is_last = (s == last) & (k == v - 1)

            def idle(state):
                inbox_b, stash, g_layers, g_shared, loss = state
                return inbox_b, stash, g_layers, g_shared, loss, zeros_x, zeros_x

            def forward(state):
                inbox_b, stash, g_layers, g_shared, loss = state
                on = first.astype(inbox_f.dtype)
                tokens_bT, docs = inputs(mb)
                # Embedding and head run on every stage and are masked: a cond on the stage
                # index inside the partially manual shard_map trips XLA's sharding verifier.
                x = on * stages.embed(shared, tokens_bT, docs) + (1 - on) * inbox_f[slot]
                stash = stash.at[slot].set(x)
                y = stages.body(chunk, x, docs)
                val, (gs, dy) = jax.value_and_grad(head_loss, argnums=(0, 1))(shared, y, mb)
                inbox_b = jnp.where(is_last, inbox_b.at[slot].set(dy), inbox_b)
                g_shared = jax.tree.map(lambda g, d: g + d * is_last.astype(d.dtype), g_shared, gs)
                loss = loss + val * is_last.astype(val.dtype)
                return inbox_b, stash, g_layers, g_shared, loss, y, zeros_x

            def backward(state):
                inbox_b, stash, g_layers, g_shared, loss = state
                tokens_bT, docs = inputs(mb)
                # Recompute the forward; the documents are constants here, not differentiated.
                _, vjp = jax.vjp(lambda w, x: stages.body(w, x, docs), chunk, stash[slot])
                gl, dx = vjp(inbox_b[slot])
                g_layers = jax.tree.map(lambda g, d: g.at[k].add(d), g_layers, gl)
                _, vjp_e = jax.vjp(lambda w: stages.embed(w, tokens_bT, docs), shared)
                ge = vjp_e(dx)[0]
                g_shared = jax.tree.map(lambda g, d: g + d * first.astype(d.dtype), g_shared, ge)
                return inbox_b, stash, g_layers, g_shared, loss, zeros_x, dx

            state = (inbox_b, stash, g_layers, g_shared, loss)
            inbox_b, stash, g_layers, g_shared, loss, send_f, send_b = jax.lax.switch(
                op, (idle, forward, backward), state
            )
            return (inbox_f, inbox_b, stash, g_layers, g_shared, loss, send_f, send_b), None

        carry = (buf, buf, buf, zero(layers), zero(shared), jnp.float32(0), zeros_x, zeros_x)
        carry, _ = jax.lax.scan(tick, carry, (ops, mbs, chunks, slot_t, recv_f, recv_b))
        _, _, _, g_layers, g_shared, loss, _, _ = carry
        if v > 1:
            g_layers = _shuffle(g_layers, shuffle_plan(p, v, back=True), s, axis, p, v)
        g_layers = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), g_layers)
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
        in_specs=(layer_spec, shared_spec, P(), *[P()] * len(tables)),
        out_specs=(P(), layer_spec, shared_spec),
        check_vma=False,
    )(layers, shared, micro_MbT1, *tables)
    return loss, {**g_layers, **g_shared}
