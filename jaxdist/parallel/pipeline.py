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

Weights move once per step: the batch axes are manual inside the shard_map too, so each stage
gathers its weights over them before the first tick and reduces their gradients after the last
(jaxdist.parallel.stage_weights), instead of the partitioner doing both on every tick.

Pays in: the bubble (idle ticks), the recompute (one extra forward per stage), the
point-to-point bytes (one activation forward and one gradient back per tick and chunk), and
memory: a stage's weights gathered, and their gradients accumulated, for the whole step.

The last stage's loss is the step's fused cross-entropy (jaxdist.kernels.fused_loss) where the model
offers its features: forward ticks hold one chunk of logits, backward ticks a microbatch's
rebuilt activations, never both (the planner prices the larger).

Packed documents (`eos_id`): every stage derives the microbatch's documents from its tokens,
which every stage holds, so nothing more travels between stages.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.kernels import documents
from jaxdist.parallel import stage_weights
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
    body: Callable  # (layer weights, x_bTD, docs) -> (x_bTD, auxiliary loss share)
    head: Callable  # (weights, x_bTD) -> logits_bTV
    axes: dict  # name -> the weight's logical axes (jaxdist.axes)
    compute_dtype: str = "float32"  # weights are gathered in it
    # (weights, x_bTD) -> (h_bTD, head_DV), logits = h @ head: for the fused loss, which never
    # holds a microbatch's whole logits (jaxdist.kernels.fused_loss); None: the loss takes `head`'s.
    features: Callable | None = None


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
    compute_bytes: int | None = None,
) -> float:
    """Bytes each device sends over the pipeline axis per step (`jaxdist comm` checks them
    against the compiled HLO): activations and their gradients every tick, and, interleaved,
    the stage's stored layer shard moved into place (in the compute dtype, `compute_bytes`;
    stored dtype if None) and its gradients back (stored dtype)."""
    layers = grads = 0.0
    if schedule.virtual > 1:
        for var in _layer_vars(abstract_params):
            value = var.get_value()
            local = local_elements(value.shape, logical_axes(var), rules, mesh_shape, "param")
            layers += local * (compute_bytes or value.dtype.itemsize)
            grads += local * value.dtype.itemsize
    return permute_bytes(schedule, activation_bytes, layers, grads)


def branch_share(schedule: Schedule) -> dict[int, tuple[float, ...]]:
    """How often each branch of the tick's switch (idle, forward, backward) runs per tick, for
    reading the compiled step's collectives (jaxdist.planning.hlo): a branch's collectives run
    only on its ticks. Averaged over the stages (each runs the same count of each)."""
    ops = np.asarray(schedule.ops)
    return {3: tuple(float((ops == op).mean()) for op in range(3))}


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
    head_loss: Callable,
    scale,
    schedule: Schedule,
    microbatches: int,
    axis: str = "pipeline",
    eos_id: int | None = None,
):
    """(mean loss over the microbatches, gradients for every weight, mean auxiliary loss the
    stages added: MoE balance), pipelined; with `eos_id`, rows are packed documents
    (jaxdist.kernels.documents), each seen alone. `head_loss(weights, y_bTD, targets_bT)` is the
    last stage's mean loss from its output (jaxdist.step.stage_loss)."""
    rules, mesh = active()
    p, v = mesh.shape[axis], schedule.virtual
    # The batch axes are manual too: weights move once per step (jaxdist.parallel.stage_weights).
    batch = stage_weights.batch_axes(rules, dict(mesh.shape))
    nb = math.prod(mesh.shape[a] for a in batch)
    specs = {
        k: stage_weights.manual_spec(stages.axes[k], rules, {axis, *batch}) for k in stages.weights
    }
    dtype = jnp.dtype(stages.compute_dtype)
    auto = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in {axis, *batch})
    ax = stages.axes
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
        stored_layers, stored_shared = layers, shared
        chunked = {k: (None, *ax[k]) for k in layers}  # logical axes of [v, chunk layers, ...]
        # [v, layers per chunk, ...]: this stage's chunks in the order it runs them, moved
        # into place (interleaved) as stored shards in the compute dtype, before the gather.
        layers = {k: w.astype(dtype).reshape(v, -1, *w.shape[1:]) for k, w in layers.items()}
        if v > 1:
            layers = _shuffle(layers, shuffle_plan(p, v), s, axis, p, v)
        layers = {
            k: stage_weights.gather(w, chunked[k], rules, batch, auto, dtype)
            for k, w in layers.items()
        }
        shared = {
            k: stage_weights.gather(w, ax[k], rules, batch, auto, dtype) for k, w in shared.items()
        }
        layers = stage_weights.laid_out(layers, stages.axes, lead=1)
        shared = stage_weights.laid_out(shared, stages.axes)

        def inputs(i):  # microbatch i's input tokens and their documents (or None)
            tokens_bT = micro_MbT1[i, :, :-1]
            return tokens_bT, None if eos_id is None else documents.from_tokens(tokens_bT, eos_id)

        x0 = stages.embed(shared, *inputs(0))
        zeros_x = jnp.zeros(x0.shape, x0.dtype)
        buf = jnp.zeros((slots, *x0.shape), x0.dtype)

        def last_loss(shared, y, i):
            # This device's rows: the batch mean is the sum over the nb batch shards / nb.
            return head_loss(shared, y, micro_MbT1[i, :, 1:]) * scale / (M * nb)

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
                y, aux = stages.body(chunk, x, docs)
                loss = loss.at[1].add(aux * scale / (M * nb))
                val, (gs, dy) = jax.value_and_grad(last_loss, argnums=(0, 1))(shared, y, mb)
                inbox_b = jnp.where(is_last, inbox_b.at[slot].set(dy), inbox_b)
                g_shared = jax.tree.map(
                    lambda g, d: g + d.astype(g.dtype) * is_last.astype(g.dtype), g_shared, gs
                )
                loss = loss.at[0].add(val * is_last.astype(val.dtype))
                return inbox_b, stash, g_layers, g_shared, loss, y, zeros_x

            def backward(state):
                inbox_b, stash, g_layers, g_shared, loss = state
                tokens_bT, docs = inputs(mb)
                # Recompute the forward; the documents are constants here, not differentiated.
                _, vjp = jax.vjp(lambda w, x: stages.body(w, x, docs), chunk, stash[slot])
                # The stage's auxiliary loss (MoE balance) joins the objective like the head's.
                gl, dx = vjp((inbox_b[slot], jnp.asarray(scale / (M * nb), jnp.float32)))
                g_layers = jax.tree.map(lambda g, d: g.at[k].add(d.astype(g.dtype)), g_layers, gl)
                _, vjp_e = jax.vjp(lambda w: stages.embed(w, tokens_bT, docs), shared)
                ge = vjp_e(dx)[0]
                g_shared = jax.tree.map(
                    lambda g, d: g + d.astype(g.dtype) * first.astype(g.dtype), g_shared, ge
                )
                return inbox_b, stash, g_layers, g_shared, loss, zeros_x, dx

            state = (inbox_b, stash, g_layers, g_shared, loss)
            inbox_b, stash, g_layers, g_shared, loss, send_f, send_b = jax.lax.switch(
                op, (idle, forward, backward), state
            )
            return (inbox_f, inbox_b, stash, g_layers, g_shared, loss, send_f, send_b), None

        g0_layers = stage_weights.zeros_like_stored(layers, stored_layers)
        g0_layers = stage_weights.laid_out(g0_layers, stages.axes, lead=1)
        g0_shared = stage_weights.laid_out(
            stage_weights.zeros_like_stored(shared, stored_shared), stages.axes
        )
        # loss: [cross-entropy, auxiliary], this device's share.
        carry = (buf, buf, buf, g0_layers, g0_shared, jnp.zeros(2, jnp.float32), zeros_x, zeros_x)
        carry, _ = jax.lax.scan(tick, carry, (ops, mbs, chunks, slot_t, recv_f, recv_b))
        _, _, _, g_layers, g_shared, loss, _, _ = carry
        g_layers = {
            k: stage_weights.reduce(g, chunked[k], rules, batch, auto) for k, g in g_layers.items()
        }
        if v > 1:  # the reduced shards, in the stored dtype, back to the stored placement
            g_layers = _shuffle(g_layers, shuffle_plan(p, v, back=True), s, axis, p, v)
        g_layers = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), g_layers)
        # Shared weights got contributions on the first and last stage only.
        g_shared = {
            k: stage_weights.reduce(g, ax[k], rules, batch, auto, extra=(axis,))
            for k, g in g_shared.items()
        }
        return jax.lax.psum(loss, (axis, *batch)), g_layers, g_shared

    # Inside, the batch is already split (manual axes; `constrain` names only the others). The
    # vocabulary stays split over `tensor` as outside: with only `pipeline` manual, XLA 0.11's
    # partitioner aborted on it ("Check failed: partition_group_list"), not with the batch
    # axes manual too.
    layer_spec = {k: specs[k] for k in layers}
    shared_spec = {k: specs[k] for k in shared}
    losses, g_layers, g_shared = jax.shard_map(
        per_stage,
        mesh=mesh,
        axis_names={axis, *batch},
        in_specs=(layer_spec, shared_spec, P(None, batch), *[P()] * len(tables)),
        out_specs=(P(), layer_spec, shared_spec),
        check_vma=False,
    )(layers, shared, micro_MbT1, *tables)
    return losses[0], {**g_layers, **g_shared}, losses[1]
