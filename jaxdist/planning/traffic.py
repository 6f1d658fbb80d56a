"""The collectives a layout implies, per mesh axis and kind: what `plan` prices and what
jaxdist.compiled.comm_report sets beside the compiled program's.

Expected bytes come from two sources. Parameters (generic, from the rule table): a weight
split over a batch axis (FSDP) is gathered where it is used, once per step, or twice for
weights inside the layer scan (forward, then again in the backward loop, since keeping every
gathered layer would undo FSDP); every gradient is reduced over the batch axes. Activations
(declared by the model as `PartialSum`s): a matmul whose contracted or produced dim is split
leaves a partial sum that is all-reduced over that split (Megatron tensor parallelism).

Pipelined layouts (a `pipeline` axis of more than one device) move weights by their own rule
(jaxdist.parallel.stage_weights): each stage gathers its weights over the batch axes once per
step, and reduces their gradients, in the stored dtype, once per step.

Bytes follow one convention for every kind: the full buffer a device reduces or gathers
(all-reduce: its input; all-gather: its output; reduce-scatter: its input).

Which collectives the compilers emit, and where, was counted in the programs of one release of
each: jax 0.11.2's XLA (XLA:CPU; XLA:GPU through jax-cuda13-plugin 0.11.2) and libtpu 0.0.48's
TPU compiler. The rules below that copy a compiler's choice (STREAMED_CHIPS, the
all-reduce-scatter fusion read in compiled.hlo, GPU's and TPU's reassociated partial sums in
models/inventory.py) are theirs; another release may choose otherwise, which `plan --verify`
and `jaxdist comm` show beside the figures.
"""

import math

from flax import nnx
from jax.sharding import Mesh

from jaxdist.kernels.lookup import Route, routed_table
from jaxdist.layout import AxisRules, Layout, ways
from jaxdist.optim import muon_dims
from jaxdist.parallel import muon, pipeline, schedules
from jaxdist.parallel.collective_matmul import check as collective_matmul_check
from jaxdist.parallel.collective_matmul import shards_sent
from jaxdist.planning import memory
from jaxdist.planning.inputs import PartialSum, PlanModel
from jaxdist.planning.layouts import abstract_mesh
from jaxdist.rules import logical_axes, variables

# XLA's TPU compiler streams a stored-split weight through each matmul that uses it instead
# of gathering it whole ("windowed einsums": loops of collective-permutes inside the dot)
# where the weight is gathered over exactly the axes that split the tokens (FSDP, with or
# without context) and that group holds 8 to 32 chips. Each use sends n - 1 shards of 1/n one
# way round the ring, what an all-gather moves (jaxdist's default), or 2n + 1 both ways (XLA's:
# jaxdist.parallel.collective_matmul): the forward, the input gradient, and the weight
# gradient (the reduce-scatter, streamed the same way). Where
# the backward reruns the forward matmul (`reruns`: full remat), the compiler gathers the
# weight once, plainly, for the rerun and the input gradient. Counted per dot (its op_name on
# each permute) in the compiled HLO of Llama-style layers on v5p-16 (fsdp=8, context=4,fsdp=2),
# v5p-32 (fsdp=16) and v5p-64 (fsdp=32). Not at 4 chips (plain all-gathers), beside `data`
# (the tokens split wider than the weight), at 64 (whole-torus all-reduces:
# experiments/tpu_gathers.py), nor beside `tensor` (some uses streamed, some gathered).
STREAMED_CHIPS = (8, 32)


def _streamed(mesh: Mesh, gather, token_axes, platform: str) -> int:
    """The ring's length where the TPU compiler streams a weight gathered over `gather` through
    its matmuls, else 0."""
    split = {a for a in token_axes if mesh.shape.get(a, 1) > 1}
    n = ways(mesh.shape, gather)
    lo, hi = STREAMED_CHIPS
    streams = platform == "tpu" and split and set(_label(mesh, gather).split("+")) == split
    return n if streams and lo <= n <= hi else 0


def _label(mesh: Mesh, axes) -> str:
    return "+".join(a for a in mesh.axis_names if a in axes and mesh.shape[a] > 1)


class _Tally:
    """Bytes per step by (axis label, kind), and how many collectives each key issues where
    every source of it says so (the embedding lookup's, once per microbatch); None: one per
    layer and microbatch."""

    def __init__(self):
        self.bytes: dict[tuple[str, str], float] = {}
        self.counts: dict[tuple[str, str], float | None] = {}

    def add(self, label: str, kind: str, nbytes: float, issued: float | None = None) -> None:
        if label:
            key = (label, kind)
            self.bytes[key] = self.bytes.get(key, 0.0) + nbytes
            before = self.counts.get(key, 0.0)
            self.counts[key] = None if issued is None or before is None else before + issued


def expected(
    abstract_params: nnx.State,
    mesh: Mesh,
    rules: AxisRules,
    partial_sums: list[PartialSum],
    compute_bytes: int,
    microbatches: int,
    platform: str,
    tokens_BT: tuple[int, int],
    reruns: frozenset[tuple] = frozenset(),
    collective_matmul: str = "one-way",
    fused_loss: bool = True,
    messages: dict | None = None,
    optimizer: str = "adamw",
) -> dict[tuple[str, str], float]:
    """Analytic bytes per step, keyed like hlo.summarize: (axis label, kind), as `platform`'s
    compiler emits them; `messages`, where given, gets how many collectives a key issues a
    step where that is not one per layer and microbatch. `tokens_BT`: a microbatch's rows and
    sequence length. `reruns`: the logical axes of the layer weights whose forward matmul the
    backward reruns (the remat policy's). `collective_matmul`: the TPU's streamed rings,
    one-way or two-way. `fused_loss`: the step's loss is jaxdist.kernels.fused_loss
    (loss_chunk_tokens > 0). `optimizer`: muon adds its momenta's moves (parallel.muon)."""
    collective_matmul_check(collective_matmul)
    tally = _Tally()
    add = tally.add

    batch_axes = rules.mesh_axes("batch", "activation")
    seq_axes = rules.mesh_axes("seq", "activation")
    pipelined = mesh.shape.get("pipeline", 1) > 1
    route = routed_table(abstract_params, rules, dict(mesh.shape), tokens_BT, microbatches)
    for var in variables(abstract_params):
        logical = logical_axes(var)
        named = [n for n in logical if n is not None]
        if route is not None and tuple(named) == ("vocab", "embed"):
            _routed_lookup(add, mesh, route, var.shape[1] * compute_bytes, microbatches)
            continue
        param_axes = {a for n in named for a in rules.mesh_axes(n, "param")}
        act_axes = {a for n in named for a in rules.mesh_axes(n, "activation")}
        if pipelined:  # stage weights move over the batch and context axes alike
            kept = {a for n in named if n != "seq" for a in rules.mesh_axes(n, "activation")}
            moved = (set(batch_axes) | set(seq_axes)) - kept
            _stage_weight(add, mesh, var, named, param_axes, moved, compute_bytes)
            continue
        compute_size = math.prod(var.shape) / ways(mesh.shape, act_axes) * compute_bytes
        # Scanned layer weights: gathered in the forward loop and again in the backward loop,
        # per microbatch. Other weights: gathered once; XLA hoists that out of the microbatch
        # loop since they do not change within a step.
        uses = 2 * microbatches if "layers" in logical else 1
        # A pipeline stage keeps its own layers: their split over `pipeline` is never gathered.
        gather = param_axes - act_axes - {"pipeline"}
        n = _streamed(mesh, gather, set(batch_axes) | set(seq_axes), platform)
        matmul = len(named) > 2 and "layers" in named and "expert" not in named
        head = tuple(named) == ("embed", "vocab")
        seq_split = {a for a in seq_axes if mesh.shape.get(a, 1) > 1}
        if n and head and seq_split and fused_loss:
            axes = (gather, set(batch_axes), seq_split)
            _context_head(add, mesh, axes, compute_size, compute_bytes, microbatches)
            continue
        if n and (matmul or head):
            # The head: gathered once (hoisted) for the logits and their input gradient, its
            # weight gradient streamed per microbatch.
            passes = _passes(named, logical in reruns, bool(_label(mesh, act_axes)))
            streams, gathers = (microbatches, 1) if head else (microbatches * p for p in passes)
            sent = shards_sent(collective_matmul, n) / n * compute_size
            _stream(add, _label(mesh, gather), sent, compute_size, streams, gathers)
            continue
        add(_label(mesh, gather), "all-gather", uses * compute_size)
        axes = (gather, act_axes, set(batch_axes), set(seq_axes))
        _gradient(add, mesh, logical, axes, compute_size, microbatches, platform)
    _activations(add, mesh, rules, partial_sums)
    if optimizer == "muon":  # once a step, after the gradients' reductions
        for m in muon.moved(abstract_params, rules, dict(mesh.shape), muon_dims):
            add(_label(mesh, m.axes), m.kind, m.nbytes, m.count)
    # Not modelled: scalar reductions (loss, norms), a few bytes that show as unexpected rows.
    if messages is not None:
        messages.update({k: n for k, n in tally.counts.items() if n})
    return tally.bytes


def _activations(add, mesh: Mesh, rules: AxisRules, partial_sums: list[PartialSum]) -> None:
    """The model's activation traffic: each partial sum reduced (or buffer exchanged) across
    the split of its `over` axis."""
    for ps in partial_sums:
        over = rules.mesh_axes(ps.over, "activation")
        named = [n for n in ps.logical if n is not None]
        spec_axes = {a for n in named for a in rules.mesh_axes(n, "activation")}
        size = math.prod(ps.shape) / ways(mesh.shape, spec_axes) * ps.dtype_bytes
        add(_label(mesh, over), ps.kind, ps.count * size)


def _passes(named, rerun: bool, tensor_split: bool) -> tuple[int, int]:
    """(streams, plain gathers) of a streamed layer weight in one step's forward and backward
    (STREAMED_CHIPS). A matmul that contracts a dim split over `tensor` (its result a partial
    sum) takes the weight gathered: the forward of an output projection (its input dim is
    split), the input gradient of an input projection (its output dim is). A backward that
    uses the weight twice (the forward's rerun and the input gradient) gathers it once. The
    weight gradient is always streamed."""
    output_projection = named[-1] == "embed"  # o, down: [.., embed] out, the rest in
    gathered_forward = tensor_split and output_projection
    gathered_backward = rerun or (tensor_split and not output_projection)
    streams = 1 + (not gathered_forward) + (not gathered_backward)
    return streams, gathered_forward + gathered_backward


def _context_head(add, mesh: Mesh, axes, nbytes: float, compute_bytes: int, microbatches: int):
    """The output head (`nbytes` as used) where the TPU streams weights and the sequence is
    split (context): gathered once for the logits, its gradient not streamed. The fused loss's
    fp32 sum over a chunk's positions is pending across the sequence's devices, and the compiler
    reduce-scatters it in fp32 before the cast (its all-reduce-scatter fusion: hlo._scatters),
    per microbatch; the batch shards' cast sums then meet in the stored layout by an all-to-all
    of the sequence devices' slice (jaxdist.kernels.fused_loss._to_stored_layout). `axes`:
    (gathered, batch, sequence)."""
    gather, batch, seq = axes
    add(_label(mesh, gather), "all-gather", nbytes)
    add(_label(mesh, seq), "reduce-scatter", microbatches * nbytes / compute_bytes * 4)
    add(_label(mesh, gather & batch), "all-to-all", microbatches * nbytes / ways(mesh.shape, seq))


def _stream(add, label: str, sent: float, nbytes: float, streams: int, gathers: int) -> None:
    """A weight (`nbytes` whole) the TPU compiler streams through its matmuls `streams` times a
    step (each sends `sent` bytes: STREAMED_CHIPS), and gathers whole `gathers` times."""
    add(label, "collective-permute", streams * sent)
    add(label, "all-gather", gathers * nbytes)


def _gradient(add, mesh: Mesh, logical, axes, compute_size: float, microbatches: int, platform):
    """One weight's gradient reduction per step. `axes`: the mesh axes it is gathered over
    where used, those its compute layout splits, the batch's and the sequence's."""
    gather, act_axes, batch_axes, seq_axes = axes
    named = [n for n in logical if n is not None]
    # XLA's CPU pipeline emits the reduce-scatter of a sum that lands sharded as an all-reduce.
    reduce_scatter = platform != "cpu"
    # Gradient: summed over the batch axes, except those the weight is also split over
    # where it is used (experts: each device holds the tokens routed to its experts).
    # A layer weight split over some of them (FSDP) is used in its stored layout, so its
    # sum lands sharded: reduced over those axes first (a reduce-scatter; XLA's CPU
    # pipeline emits an all-reduce), then the shard all-reduced over the other batch axes.
    # Expert weights take the same two steps, by the explicit all_gather inside
    # jaxdist.parallel.experts' shard_map, whose transpose is a reduce-scatter; so does
    # the output head [embed, vocab], used gathered but its gradient landing in its stored
    # layout (rules.gathered). The embedding table's, where the lookup gathers it, is
    # reduce-scattered explicitly over every token axis it is stored split over
    # (jaxdist.kernels.lookup; on TPU as a ring of permutes, (n - 1) / n of it), all-reduced
    # over the others; where the lookup is routed, see _routed_lookup. Other weights are summed
    # in one all-reduce over every batch axis: a layer's vectors (norm scales: reductions
    # over the batch's tokens), whole; a layer's weight with one named dim (the router,
    # [embed, experts]), as the slice it is stored as.
    reduce_over = batch_axes - act_axes
    head = tuple(named) == ("embed", "vocab")
    one_dim = "layers" in logical and len(named) == 2
    if tuple(named) == ("vocab", "embed"):
        tokens = batch_axes | seq_axes
        scattered, size = tokens & gather, microbatches * compute_size
        _lookup_gradient(add, mesh, scattered, tokens - gather, size, platform)
    elif one_dim and len(logical) > 2:
        add(_label(mesh, reduce_over), "all-reduce", compute_size / ways(mesh.shape, gather))
    elif _label(mesh, gather) and ("layers" in logical or head) and not one_dim:
        first = "reduce-scatter" if reduce_scatter or "expert" in named else "all-reduce"
        add(_label(mesh, gather), first, microbatches * compute_size)
        add(
            _label(mesh, reduce_over - gather),
            "all-reduce",
            microbatches * compute_size / ways(mesh.shape, gather),
        )
    else:
        kind = "reduce-scatter" if reduce_scatter and _label(mesh, gather) else "all-reduce"
        add(_label(mesh, reduce_over), kind, microbatches * compute_size)
        # A split sequence (context): its devices hold other tokens of the same rows, so
        # the sum goes over them too, as XLA emits it: a second all-reduce, over them.
        add(_label(mesh, seq_axes - act_axes), "all-reduce", microbatches * compute_size)


def _lookup_gradient(add, mesh: Mesh, scattered, summed, nbytes: float, platform: str) -> None:
    """The embedding table's gradient, as jaxdist.kernels.lookup reduces it (per microbatch:
    `nbytes`, the caller's count)."""
    n = ways(mesh.shape, scattered)
    if platform == "tpu":
        add(_label(mesh, scattered), "collective-permute", nbytes * (n - 1) / n)
    else:
        add(_label(mesh, scattered), "reduce-scatter", nbytes)
    add(_label(mesh, summed), "all-reduce", nbytes / n)


def _routed_lookup(add, mesh: Mesh, route: Route, row_bytes: float, microbatches: int) -> None:
    """The routed embedding lookup (jaxdist.kernels.lookup), per microbatch: the group's token
    ids gathered (int32; the backward's gather is the forward's, to XLA), this device's
    tokens' rows all-to-all forward and backward, the gradient's slice summed over the other
    token axes."""
    n = ways(mesh.shape, route.split)
    label = _label(mesh, route.split)
    # Once per microbatch (the ids, the gradient's slice), twice for the rows (forward and
    # backward): not once per layer.
    m = microbatches
    add(label, "all-gather", m * n * route.tokens * 4, m)
    add(label, "all-to-all", 2 * m * route.tokens * row_bytes, 2 * m)
    add(_label(mesh, route.summed), "all-reduce", m * route.rows * row_bytes / n, m)


def _stage_weight(add, mesh: Mesh, var, named, param_axes, moved_axes, compute_bytes) -> None:
    """One weight's bytes per step in a pipelined layout: gathered once over the batch axes it
    is split over (compute dtype); its gradient reduce-scattered back over them and all-reduced
    over the other batch axes, in the stored dtype; weights outside the layers (embedding,
    head) are also summed over `pipeline`, every stage adding to them. `moved_axes`: the batch
    axes but those the weight's compute layout splits too (experts)."""
    batch = {a for a in moved_axes if mesh.shape.get(a, 1) > 1}
    gather = param_axes & batch
    local = math.prod(var.shape) / ways(mesh.shape, param_axes - gather)  # gathered, per device
    stored = var.get_value().dtype.itemsize
    add(_label(mesh, gather), "all-gather", local * compute_bytes)
    add(_label(mesh, gather), "reduce-scatter", local * stored)
    rest = (batch - gather) | (set() if "layers" in named else {"pipeline"})
    add(_label(mesh, rest), "all-reduce", local / ways(mesh.shape, gather) * stored)


def layout_bytes(
    model: PlanModel,
    layout: Layout,
    platform: str,
    messages: dict | None = None,
    optimizer: str = "adamw",
) -> dict[tuple[str, str], float]:
    """Collective bytes per step of one layout by (axis label, kind), as `platform`'s compiler
    emits them: the one price of a layout's traffic, which `plan` and `jaxdist comm` read.
    `model` at its own remat policy (the weights its backward reruns); a pipeline adds its
    stages' sends; `messages`: see `expected`."""
    out = expected(
        model.abstract_params,
        abstract_mesh(layout),
        layout.rules,
        model.partial_sums(layout, platform),
        model.compute_bytes,
        layout.microbatches,
        platform=platform,
        tokens_BT=(layout.micro_rows, layout.seq_len),
        reruns=model.reruns,
        collective_matmul=layout.step.collective_matmul,
        fused_loss=layout.step.loss_chunk_tokens > 0,
        messages=messages,
        optimizer=optimizer,
    )
    if layout.stages > 1:
        out[("pipeline", "collective-permute")] = pipeline.send_bytes(
            schedules.for_layout(layout),
            model.abstract_params,
            layout.rules,
            layout.mesh_shape,
            memory.microbatch_activation(model, layout),
            model.compute_bytes,
        )
    return out
