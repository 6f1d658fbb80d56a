"""Pipeline parallelism: the layers split into stages along the `pipeline` mesh axis.

Each device runs its stage's share of the layers (`layers` is split over `pipeline`), and a
static schedule (jaxdist.parallel.schedules: gpipe, 1f1b, interleaved) says, tick by tick, which
microbatch each stage runs forward (F) or backward (B), and with interleaving on which of its
virtual stages; activations move one chunk on and gradients one chunk back by collective
permutes at the end of every tick (around a ring when interleaved: the last stage's chunk k
feeds the first stage's chunk k+1). A stage keeps only its microbatches' inputs and recomputes
its forward in the backward pass. This module runs a stage's step (gather its weights, scan
the ticks, reduce its gradients); one tick's work is jaxdist.parallel.ticks.

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
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.layout import REPLICA, AxisRules
from jaxdist.model import Stages
from jaxdist.parallel import context, stage_weights, ticks
from jaxdist.parallel.schedules import (  # noqa: F401 - re-exported: the pipeline's public surface
    SCHEDULES,
    Schedule,
    make_schedule,
    permute_bytes,
    recv_table,
    shuffle_plan,
)
from jaxdist.rules import active, local_elements, logical_axes, variables


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
    reading the compiled step's collectives (jaxdist.compiled.hlo): a branch's collectives run
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


class Pipeline(NamedTuple):
    """The step's pipeline, fixed before the shard_map: the model's pieces and loss, the
    schedule's sizes and the mesh axes the stages gather and reduce over."""

    stages: Stages
    head_loss: Callable  # (weights, y_bTD, targets_bT) -> the last stage's mean loss
    scale: Any  # the step's loss scale
    microbatches: int
    eos_id: int | None
    axis: str  # the pipeline mesh axis
    p: int  # pipeline stages
    v: int  # virtual stages (chunks) per stage
    slots: int  # each buffer's microbatch slots: capacity per virtual stage
    rules: AxisRules
    batch: tuple[str, ...]  # the batch axes, manual inside the shard_map too
    nb: int  # devices over the batch axes
    auto: tuple[str, ...]  # the axes left to the partitioner (tensor, ...)
    dtype: Any  # the compute dtype weights are gathered in

    def chunked_axes(self, keys) -> dict:
        """Logical axes of the stacked layer weights cut in chunks: [v, chunk layers, ...]."""
        return {k: (None, *self.stages.axes[k]) for k in keys}


def _tables(schedule: Schedule) -> tuple[jax.Array, ...]:
    """The schedule's per-tick, per-stage rows the scan runs over: op, microbatch, chunk, slot
    and the slots the forward and backward arrivals land in (-1: none)."""
    return tuple(
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


def _gathered(pipe: Pipeline, s, layers: dict, shared: dict) -> tuple[dict, dict]:
    """This stage's weights whole over the batch axes, in the compute dtype: its layer chunks
    [v, layers per chunk, ...] in the order it runs them (moved into place, interleaved, as
    stored shards before the gather) and the shared weights."""
    rules, batch, auto, dtype, ax = pipe.rules, pipe.batch, pipe.auto, pipe.dtype, pipe.stages.axes
    chunked = pipe.chunked_axes(layers)
    layers = {k: w.astype(dtype).reshape(pipe.v, -1, *w.shape[1:]) for k, w in layers.items()}
    if pipe.v > 1:
        layers = _shuffle(layers, shuffle_plan(pipe.p, pipe.v), s, pipe.axis, pipe.p, pipe.v)
    layers = {
        k: stage_weights.gather(w, chunked[k], rules, batch, auto, dtype) for k, w in layers.items()
    }
    shared = {
        k: stage_weights.gather(w, ax[k], rules, batch, auto, dtype) for k, w in shared.items()
    }
    layers = stage_weights.laid_out(layers, ax, lead=1)
    shared = stage_weights.laid_out(shared, ax)
    return layers, shared


def _reduced(pipe: Pipeline, s, g_layers: dict, g_shared: dict) -> tuple[dict, dict]:
    """The stage's accumulated gradients summed over the batch axes, as the weights are stored."""
    rules, batch, auto, ax = pipe.rules, pipe.batch, pipe.auto, pipe.stages.axes
    chunked = pipe.chunked_axes(g_layers)
    g_layers = {
        k: stage_weights.reduce(g, chunked[k], rules, batch, auto) for k, g in g_layers.items()
    }
    if pipe.v > 1:  # the reduced shards, in the stored dtype, back to the stored placement
        back = shuffle_plan(pipe.p, pipe.v, back=True)
        g_layers = _shuffle(g_layers, back, s, pipe.axis, pipe.p, pipe.v)
    g_layers = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), g_layers)
    # Shared weights got contributions on the first and last stage only.
    g_shared = {
        k: stage_weights.reduce(g, ax[k], rules, batch, auto, extra=(pipe.axis,))
        for k, g in g_shared.items()
    }
    return g_layers, g_shared


def _per_stage(pipe: Pipeline, layers, shared, feed, *tables):
    """One device's stage for the whole step (inside the shard_map): gather its weights, run
    the schedule's ticks, reduce its gradients. Returns (loss sums, layer and shared grads)."""
    s = jax.lax.axis_index(pipe.axis)
    stored_layers, stored_shared = layers, shared
    layers, shared = _gathered(pipe, s, layers, shared)
    x0 = pipe.stages.embed(shared, *ticks.inputs(feed, pipe.eos_id, 0))
    zeros_x = jnp.zeros(x0.shape, x0.dtype)
    buf = jnp.zeros((pipe.slots, *x0.shape), x0.dtype)
    g0_layers = stage_weights.zeros_like_stored(layers, stored_layers)
    g0_layers = stage_weights.laid_out(g0_layers, pipe.stages.axes, lead=1)
    g0_shared = stage_weights.laid_out(
        stage_weights.zeros_like_stored(shared, stored_shared), pipe.stages.axes
    )
    ctx = ticks.StageContext(
        pipe.stages,
        pipe.head_loss,
        feed,
        layers,
        shared,
        s,
        pipe.p,
        pipe.v,
        pipe.axis,
        pipe.eos_id,
        pipe.scale,
        pipe.microbatches * pipe.nb,
        zeros_x,
    )
    # loss: [cross-entropy, auxiliary], this device's share.
    held = ticks.Held(buf, buf, g0_layers, g0_shared, jnp.zeros(2, jnp.float32))
    carry, _ = jax.lax.scan(
        partial(ticks.tick, ctx), ticks.Carry(buf, held, zeros_x, zeros_x), tables
    )
    g_layers, g_shared = _reduced(pipe, s, carry.held.g_layers, carry.held.g_shared)
    return jax.lax.psum(carry.held.loss, (pipe.axis, *pipe.batch)), g_layers, g_shared


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
    last stage's mean loss from its output (jaxdist.kernels.loss.stage_loss)."""
    rules, mesh = active()
    # The batch axes are manual too: weights move once per step (jaxdist.parallel.stage_weights).
    batch = stage_weights.batch_axes(rules, dict(mesh.shape))
    pipe = Pipeline(
        stages,
        head_loss,
        scale,
        microbatches,
        eos_id,
        axis,
        p=mesh.shape[axis],
        v=schedule.virtual,
        slots=schedule.virtual * schedule.capacity,
        rules=rules,
        batch=batch,
        nb=math.prod(mesh.shape[a] for a in batch),
        auto=tuple(
            a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in {axis, *batch, REPLICA}
        ),
        dtype=jnp.dtype(stages.compute_dtype),
    )
    specs = {
        k: stage_weights.manual_spec(stages.axes[k], rules, {axis, *batch}) for k in stages.weights
    }
    feed, feed_specs = _feed(tokens_BT1, microbatches, eos_id, rules, batch)
    layers = {k: stages.weights[k] for k in stages.layer_keys}
    shared = {k: w for k, w in stages.weights.items() if k not in layers}
    tables = _tables(schedule)
    # Inside, the batch is already split (manual axes; `constrain` names only the others). The
    # vocabulary stays split over `tensor` as outside: with only `pipeline` manual, XLA 0.11's
    # partitioner aborted on it ("Check failed: partition_group_list"), not with the batch
    # axes manual too.
    layer_spec = {k: specs[k] for k in layers}
    shared_spec = {k: specs[k] for k in shared}
    in_specs = (layer_spec, shared_spec, feed_specs, P(), *[P()] * len(tables))
    out_specs = (P(), layer_spec, shared_spec)

    def run(layers, shared, feed, scale, *tables):
        return jax.shard_map(
            partial(_stage, pipe),
            mesh=mesh,
            axis_names={axis, *batch},
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=False,
        )(layers, shared, feed, scale, *tables)

    if mesh.shape.get(REPLICA, 1) > 1:
        run = _mapped_over_groups(run, pipe, mesh, in_specs, out_specs)
    losses, g_layers, g_shared = run(layers, shared, feed, jnp.asarray(scale), *tables)
    return losses[0], {**g_layers, **g_shared}, losses[1]


def _mapped_over_groups(run: Callable, pipe: Pipeline, mesh, in_specs, out_specs) -> Callable:
    """`run` as replica groups map it (jaxdist.parallel.replica: the step under
    `vmap(spmd_axis_name="replica")`): one shard_map with `replica` manual too, each device
    running its group's stage on its group's [1, ...] slice. jax 0.11's own batching of the
    shard_map gives the groups a wrong local shape, and with `replica` manual it would add
    `replica` to the sharding constraints inside, where a manual axis may not appear."""
    manual = {pipe.axis, *pipe.batch, REPLICA}
    grouped_in = jax.tree.map(lambda s: P(REPLICA, *s), in_specs, is_leaf=_is_spec)
    grouped_out = jax.tree.map(lambda s: P(REPLICA, *s), out_specs, is_leaf=_is_spec)

    def one(*args):  # this device's group: drop the groups' dim, run the stage, put it back
        out = _stage(pipe, *jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    mapped = jax.custom_batching.custom_vmap(run)

    @mapped.def_vmap
    def rule(axis_size, in_batched, *args):
        args = jax.tree.map(
            lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *jnp.shape(x))),
            args,
            tuple(in_batched),
        )
        out = jax.shard_map(
            one,
            mesh=mesh,
            axis_names=manual,
            in_specs=grouped_in,
            out_specs=grouped_out,
            check_vma=False,
        )(*args)
        return out, jax.tree.map(lambda _: True, out)

    return mapped


def _stage(pipe: Pipeline, layers, shared, feed, scale, *tables):
    """_per_stage with the step's loss scale an argument of the shard_map (a traced value the
    groups' map must see, not a constant it closes over)."""
    return _per_stage(pipe._replace(scale=scale), layers, shared, feed, *tables)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _feed(tokens_BT1, M: int, eos_id: int | None, rules, manual) -> tuple[dict, dict]:
    """The microbatches as the stages read them (ticks.inputs), and their specs. Microbatch m
    takes rows m, m+M, ...: each device keeps its own rows. A sequence split over `context`
    is reordered here, before the pipeline, documents found first (jaxdist.parallel.context);
    each device then holds its share of the positions too."""
    B = tokens_BT1.shape[0]
    rows = tuple(a for a in manual if a in rules.mesh_axes("batch", "activation"))
    seq = tuple(a for a in manual if a in rules.mesh_axes("seq", "activation"))

    def micro(x_BX):  # [B, ...] -> [M, B / M, ...]
        return x_BX.reshape(B // M, M, *x_BX.shape[1:]).swapaxes(0, 1)

    if not seq:
        return {"tokens": micro(tokens_BT1)}, {"tokens": P(None, rows)}
    inputs_BT, targets_BT, docs = context.inputs_and_targets(tokens_BT1, eos_id)
    feed = {
        "inputs": micro(inputs_BT),
        "targets": micro(targets_BT),
        "positions": micro(jnp.broadcast_to(docs.positions_BT, inputs_BT.shape)),
        "index": docs.index_T,
    }
    if docs.segment_ids_BT is not None:
        feed["segments"] = micro(docs.segment_ids_BT)
    specs = {k: P(seq) if k == "index" else P(None, rows, seq) for k in feed}
    return feed, specs
