"""One tick of a pipeline stage: the scan body of jaxdist.parallel.pipeline, one schedule row.

A tick first takes what the neighbours sent at the end of the previous tick (an activation
from the stage before, a gradient from the stage after) into the slot its schedule names, then
runs one branch of a switch on the schedule's op: idle, a microbatch's chunk forward (the first
chunk embeds the tokens, the last adds the loss and starts the backward), or a chunk backward
(its forward recomputed from the stashed input). What a branch returns is sent on at the next
tick.

State travels explicitly: a `StageContext` holds what every tick reads (fixed for the step),
`Work` this tick's row of the schedule, `Held` what a branch may change, `Carry` the scan's
whole carry.
"""

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxdist.kernels import documents
from jaxdist.model import Stages


class StageContext(NamedTuple):
    """What every tick of one device's stage reads, fixed for the step (inside the shard_map)."""

    stages: Stages
    head_loss: Callable  # (weights, y_bTD, targets_bT) -> the last stage's mean loss
    feed: dict  # this device's rows of every microbatch (see `inputs`)
    layers: dict  # [v, layers per chunk, ...]: its chunks in the order it runs them, gathered
    shared: dict  # the other weights, gathered
    index: jax.Array  # this stage's position on the pipeline axis
    p: int  # pipeline stages
    v: int  # virtual stages (chunks) per stage
    axis: str  # the pipeline mesh axis
    eos_id: int | None  # packed documents' EOS (None: a row is one sequence)
    scale: Any  # the step's loss scale (NaN on a fault-injected step)
    parts: int  # microbatches x batch shards: the batch mean sums this many shares
    zeros_x: jax.Array  # a microbatch's activation, zeros: what an idle branch sends


class Held(NamedTuple):
    """What a tick's branch may change."""

    inbox_b: jax.Array  # [slots, b, T, D]: gradients received, awaiting their backward
    stash: jax.Array  # inputs of the forwards run, for their backward's recompute
    g_layers: dict  # this stage's chunks' gradients, as gathered, in the stored dtype
    g_shared: dict  # the other weights' gradients (embedding on the first, head on the last)
    loss: jax.Array  # [cross-entropy, auxiliary], this device's share


class Carry(NamedTuple):
    inbox_f: jax.Array  # activations received, awaiting their forward
    held: Held
    send_f: jax.Array  # the last tick's output, to the next stage
    send_b: jax.Array  # the last tick's input gradient, to the previous stage


class Work(NamedTuple):
    """This tick's row of the schedule on this stage, and what it selects."""

    mb: jax.Array  # the microbatch
    k: jax.Array  # the chunk (virtual stage) it runs
    slot: jax.Array  # the buffers' slot of its input
    chunk: dict  # the chunk's layer weights
    first: jax.Array  # the model's first chunk: embeds the tokens
    is_last: jax.Array  # the model's last chunk: computes the loss
    inbox_f: jax.Array  # the activations received, this tick's arrival included


def inputs(feed: dict, eos_id: int | None, i):
    """Microbatch i's input tokens and their documents (or None). `feed` holds "tokens"
    [M, b, T+1]; or, for a sequence split over `context`, what jaxdist.parallel.context made of
    them before the pipeline: "inputs", "targets", "positions" [M, b, T], "segments" where rows
    are packed documents, and "index" [T], each token's place in the row."""
    if "index" in feed:
        segments = feed["segments"][i] if "segments" in feed else None
        return feed["inputs"][i], documents.Documents(segments, feed["positions"][i], feed["index"])
    tokens_bT = feed["tokens"][i, :, :-1]
    return tokens_bT, None if eos_id is None else documents.from_tokens(tokens_bT, eos_id)


def targets(feed: dict, i):
    return feed["targets"][i] if "index" in feed else feed["tokens"][i, :, 1:]


def neighbours(p: int, v: int) -> tuple[list, list]:
    """The permutes that send activations one stage on and gradients one stage back.
    Interleaved chunks wrap around: the last stage feeds the first stage's next chunk."""
    ring = v > 1
    fwd_perm = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    bwd_perm = [((s + 1) % p, s) for s in range(p if ring else p - 1)]
    return fwd_perm, bwd_perm


def last_loss(ctx: StageContext, shared, y, i):
    # This device's rows: the batch mean is the sum over the nb batch shards / nb.
    return ctx.head_loss(shared, y, targets(ctx.feed, i)) * ctx.scale / ctx.parts


def idle(ctx: StageContext, work: Work, held: Held):
    return held, ctx.zeros_x, ctx.zeros_x


def forward(ctx: StageContext, work: Work, held: Held):
    """The chunk's forward on the microbatch; on the last chunk, its loss and the gradient
    that starts its backward (into this stage's own backward inbox)."""
    mb, _, slot, chunk, first, is_last, inbox_f = work
    inbox_b, stash, g_layers, g_shared, loss = held
    on = first.astype(inbox_f.dtype)
    tokens_bT, docs = inputs(ctx.feed, ctx.eos_id, mb)
    # Embedding and head run on every stage and are masked: a cond on the stage
    # index inside the partially manual shard_map trips XLA's sharding verifier.
    x = on * ctx.stages.embed(ctx.shared, tokens_bT, docs) + (1 - on) * inbox_f[slot]
    stash = stash.at[slot].set(x)
    y, aux = ctx.stages.body(chunk, x, docs)
    loss = loss.at[1].add(aux * ctx.scale / ctx.parts)
    loss_and_grads = jax.value_and_grad(partial(last_loss, ctx), argnums=(0, 1))
    val, (gs, dy) = loss_and_grads(ctx.shared, y, mb)
    inbox_b = jnp.where(is_last, inbox_b.at[slot].set(dy), inbox_b)
    g_shared = jax.tree.map(
        lambda g, d: g + d.astype(g.dtype) * is_last.astype(g.dtype), g_shared, gs
    )
    loss = loss.at[0].add(val * is_last.astype(val.dtype))
    return Held(inbox_b, stash, g_layers, g_shared, loss), y, ctx.zeros_x


def backward(ctx: StageContext, work: Work, held: Held):
    """The chunk's backward on the microbatch, its forward recomputed from the stash; on the
    first chunk, the embedding's gradient too."""
    mb, k, slot, chunk, first, _, _ = work
    inbox_b, stash, g_layers, g_shared, loss = held
    tokens_bT, docs = inputs(ctx.feed, ctx.eos_id, mb)
    # Recompute the forward; the documents are constants here, not differentiated.
    _, vjp = jax.vjp(lambda w, x: ctx.stages.body(w, x, docs), chunk, stash[slot])
    # The stage's auxiliary loss (MoE balance) joins the objective like the head's.
    gl, dx = vjp((inbox_b[slot], jnp.asarray(ctx.scale / ctx.parts, jnp.float32)))
    g_layers = jax.tree.map(lambda g, d: g.at[k].add(d.astype(g.dtype)), g_layers, gl)
    _, vjp_e = jax.vjp(lambda w: ctx.stages.embed(w, tokens_bT, docs), ctx.shared)
    ge = vjp_e(dx)[0]
    g_shared = jax.tree.map(
        lambda g, d: g + d.astype(g.dtype) * first.astype(g.dtype), g_shared, ge
    )
    return Held(inbox_b, stash, g_layers, g_shared, loss), ctx.zeros_x, dx


def tick(ctx: StageContext, carry: Carry, row) -> tuple[Carry, None]:
    """One schedule row on this stage: take the neighbours' sends, then run its op."""
    op, mb, k, slot, rf, rb = (r[ctx.index] for r in row)
    fwd_perm, bwd_perm = neighbours(ctx.p, ctx.v)
    # Arrivals from the neighbours' previous tick.
    got_f = jax.lax.ppermute(carry.send_f, ctx.axis, fwd_perm)
    got_b = jax.lax.ppermute(carry.send_b, ctx.axis, bwd_perm)
    inbox_f = jnp.where(rf >= 0, carry.inbox_f.at[rf].set(got_f), carry.inbox_f)
    inbox_b = carry.held.inbox_b
    inbox_b = jnp.where(rb >= 0, inbox_b.at[rb].set(got_b), inbox_b)
    chunk = jax.tree.map(lambda w: w[k] if ctx.v > 1 else w[0], ctx.layers)
    first = (ctx.index == 0) & (k == 0)
    is_last = (ctx.index == ctx.p - 1) & (k == ctx.v - 1)
    work = Work(mb, k, slot, chunk, first, is_last, inbox_f)
    branches = tuple(partial(branch, ctx, work) for branch in (idle, forward, backward))
    held, send_f, send_b = jax.lax.switch(op, branches, carry.held._replace(inbox_b=inbox_b))
    return Carry(inbox_f, held, send_f, send_b), None
