"""Per-device memory of a training step, predicted from shapes and the rule table alone.

No compile and no devices: the planner prices hundreds of layouts this way, then `--verify`
puts XLA's memory analysis beside the figure. The model declares its activations in logical
axes (an `Inventory`); the rules say how each splits over a layout.

Terms, per device:
- state: parameters, AdamW's two moments (fp32, sharded like the parameters) and the batch;
- gradients: one fp32 buffer per parameter shard, live from the backward pass to the update;
- gathered weights: under FSDP, each weight is gathered where it is used, one scanned layer at
  a time (two in flight, so the next gather can overlap this layer), the others whole;
- activations: what each layer saves for its backward pass under the remat policy, times the
  layers (and, pipelined, the microbatches a stage holds), plus one layer's backward working
  set and what lives outside the layers (embeddings, logits);
- on TPU, what its compiler counts beyond its own buffer assignment (`tpu_copies`);
- with replica groups (DiLoCo), one group's step at its block of the batch, and the outer
  state beside it (`outer`: planning.sync.outer_state_bytes).
"""

import dataclasses
from typing import NamedTuple

from flax import nnx

from jaxdist.kernels.fused_loss import chunk_tokens_for
from jaxdist.kernels.lookup import routed_table
from jaxdist.layout import AxisRules, Layout, ways
from jaxdist.parallel import pipeline, schedules
from jaxdist.planning import sync
from jaxdist.planning.inputs import Activation, Inventory, PlanModel
from jaxdist.rules import local_elements, logical_axes, variables

ADAM_MOMENTS = 2


def with_fused_loss(inventory: Inventory, chunk_tokens: int, compute_bytes: int) -> Inventory:
    """The inventory under the step's fused cross-entropy (jaxdist.kernels.fused_loss): the
    logits the model declares ([..., vocab]) are held one chunk of at most `chunk_tokens` tokens
    per device at a time (fewer at a large vocabulary: chunk_tokens_for), as fp32 logits and
    their gradient (softmax less the target's one-hot), rounded to the compute dtype for the
    matmuls that use it."""
    once = []
    for t in inventory.once:
        if t.logical[-1:] == ("vocab",):
            rows = chunk_tokens_for(t.shape[-1], chunk_tokens)
            chunk = dataclasses.replace(t, count=1, chunk_rows=rows)
            once += [
                dataclasses.replace(chunk, dtype_bytes=4),
                dataclasses.replace(chunk, dtype_bytes=compute_bytes),
            ]
        else:
            once.append(t)
    return dataclasses.replace(inventory, once=tuple(once))


def tensors_bytes(
    tensors: tuple[Activation, ...], rules: AxisRules, mesh_shape: dict[str, int]
) -> float:
    total = 0.0
    for t in tensors:
        local = local_elements(t.shape, t.logical, rules, mesh_shape, "activation")
        if t.chunk_rows:
            row = local_elements(t.shape[-1:], t.logical[-1:], rules, mesh_shape, "activation")
            local = min(local, t.chunk_rows * row)
        total += t.count * t.dtype_bytes * local
    return total


class _Weights(NamedTuple):
    """Bytes per device of the weights' terms, and the elements a pipeline stage holds."""

    params: float
    gradients: float
    gathered_layer: float  # one scanned layer's weights gathered
    gathered_other: float  # the other weights gathered
    stage_layers: float  # elements of a pipeline stage's layers, as its ticks read them
    stage_other: float  # elements of the other weights a stage holds gathered (table, head)


def _weights(
    abstract_params: nnx.State,
    rules: AxisRules,
    mesh_shape: dict[str, int],
    compute_bytes: int,
    routed: bool,
) -> _Weights:
    """The weights' memory on one device. `routed`: the embedding table is looked up where it
    is stored."""
    pipelined = mesh_shape.get("pipeline", 1) > 1
    params = grads = gathered_layer = gathered_other = stage_layers = stage_other = 0.0
    for var in variables(abstract_params):
        logical = logical_axes(var)
        local = local_elements(var.shape, logical, rules, mesh_shape, "param")
        params += 4 * local
        grads += 4 * local
        if pipelined and "layers" in logical:  # as the stage's ticks read and accumulate them
            used = local_elements(var.shape, logical, rules, mesh_shape, "activation")
            stage_layers += max(local, used / mesh_shape["pipeline"])
        param_axes = {a for n in logical if n for a in rules.mesh_axes(n, "param")}
        act_axes = {a for n in logical if n for a in rules.mesh_axes(n, "activation")}
        in_place = routed and tuple(n for n in logical if n) == ("vocab", "embed")
        # A pipeline stage keeps its own layers: their split over `pipeline` is never gathered.
        if ways(mesh_shape, param_axes - act_axes - {"pipeline"}) > 1 and not in_place:
            used = compute_bytes * local_elements(
                var.shape, logical, rules, mesh_shape, "activation"
            )
            if pipelined:
                stage = used / (mesh_shape["pipeline"] if "layers" in logical else 1)
                gathered_other += stage
                grads += 4 * stage / compute_bytes - 4 * local
                if "layers" not in logical:
                    stage_other += stage / compute_bytes
            elif "layers" in logical:
                gathered_layer += used / var.shape[logical.index("layers")]
            else:
                gathered_other += used
    return _Weights(params, grads, gathered_layer, gathered_other, stage_layers, stage_other)


def _tpu_copies(inventory: Inventory, layout: Layout, weights: _Weights, model: PlanModel) -> float:
    """What the TPU compiler counts twice (see `device_peak`): the fp32 logits chunk, and the
    weights a pipeline stage carries through its tick loop (its layers and the table and head
    it holds gathered), as fp32 gradient accumulators and in the compute dtype."""
    fp32_logits = [t for t in inventory.once if t.logical[-1:] == ("vocab",)]
    fp32_logits = tuple(t for t in fp32_logits if t.dtype_bytes == 4)
    carried = (weights.stage_layers + weights.stage_other) * (4 + model.compute_bytes)
    return tensors_bytes(fp32_logits, layout.rules, layout.mesh_shape) + carried


def device_peak(model: PlanModel, layout: Layout, platform: str) -> dict[str, float]:
    """One device's bytes of the step by term, and their sum as `peak`: the one price of a
    layout's memory, which `plan`, `train --remat auto`, `--compile-only` and the host check
    all read. `model` is priced at its own remat policy (the layout's, where the caller built
    it so); `platform` the compiler's ("tpu" adds what its memory analysis counts twice).

    A pipeline stage keeps only its microbatches' inputs (three buffers: forward inbox,
    backward inbox and stash, each of the schedule's capacity) and rebuilds one microbatch's
    activations at a time in its backward ticks, and the head's (logits) in its forward
    ticks, never both at once. It also holds its weights gathered over the batch axes for the
    whole step, and their gradient accumulators at that size in the stored dtype
    (jaxdist.parallel.stage_weights).

    On "tpu", `tpu_copies`: the TPU compiler's memory analysis counts, beyond the buffers of
    its own assignment, about a second copy of the fp32 logits chunk, and of the state a loop
    carries and the weights it reads (experiments/tpu_loop_state.py isolates that share): for
    a pipeline stage, its weights (its layers, and the table and head it holds gathered) and
    their gradient accumulators, carried through the tick loop. Measured, not derived: compiled
    for a v5p slice by libtpu 0.0.48 (jax 0.11.2) at 7d7519e, 2026-12-01 (experiments/README.md,
    "What the TPU compiler counts beyond its buffer assignment").

    With replica groups (a `replica` axis and a SyncConfig), a device holds one group's step
    and, as `outer`, its share of the outer state (planning.sync.outer_state_bytes).
    """
    if layout.grouped:
        out = device_peak(model, layout.group_alone(), platform)
        out["outer"] = sync.outer_state_bytes(out["params"], layout)
        out["peak"] = sum(v for k, v in out.items() if k != "peak")
        return out
    mesh_shape = layout.mesh_shape
    m = layout.microbatches
    inventory = model.inventory(max(1, layout.micro_rows))
    if layout.step.loss_chunk_tokens:  # the fused loss, a pipeline's last stage's too
        inventory = with_fused_loss(inventory, layout.step.loss_chunk_tokens, model.compute_bytes)
    # A routed embedding table (jaxdist.kernels.lookup) is never gathered.
    tokens_BT = (layout.micro_rows, layout.seq_len)
    route = routed_table(model.abstract_params, layout.rules, mesh_shape, tokens_BT, m)
    w = _weights(
        model.abstract_params, layout.rules, mesh_shape, model.compute_bytes, route is not None
    )
    batch = 4 * layout.batch_size * (layout.seq_len + 1) / layout.batch_ways
    saved = tensors_bytes(inventory.saved_per_layer, layout.rules, mesh_shape)
    layers = model.num_layers // layout.stages
    backward = layers * saved + tensors_bytes(inventory.working, layout.rules, mesh_shape)
    once = tensors_bytes(inventory.once, layout.rules, mesh_shape)
    # Unpipelined, the loss runs with every layer's residuals held. A pipeline stage runs its
    # head and loss in forward ticks and rebuilds its residuals in backward ticks: the two
    # branches of the tick never hold their buffers at once.
    stash = pipeline_stash(model, layout)
    activations = (max(backward, once) if layout.stages > 1 else backward + once) + stash
    tpu_copies = _tpu_copies(inventory, layout, w, model) if platform == "tpu" else 0.0
    # A stage's backward tick gives its layers' gradients for a microbatch whole, stacked in
    # a 16-bit compute dtype, before they are cast into the fp32 accumulators (in fp32 they
    # join them in place: no such buffer in XLA:CPU's assignment).
    stage_grads = w.stage_layers * model.compute_bytes if model.compute_bytes < 4 else 0.0
    out = {
        "params": w.params,
        "optimizer": ADAM_MOMENTS * w.params,
        "batch": batch,
        "gradients": w.gradients + stage_grads,
        "gathered_weights": 2 * w.gathered_layer + w.gathered_other,
        "activations": activations,
        "tpu_copies": tpu_copies,
    }
    out["peak"] = sum(out.values())
    return out


def microbatch_activation(model: PlanModel, layout: Layout) -> float:
    """One microbatch's [rows, seq, d_model] activation on one device (its share of the rows,
    and of the sequence where `context` splits it): what a pipeline stage stores and sends."""
    return pipeline.microbatch_bytes(
        *(layout.batch_size, layout.microbatches, layout.batch_ways),
        *(layout.seq_len // layout.seq_ways, model.d_model, model.compute_bytes),
    )


def pipeline_stash(model: PlanModel, layout: Layout) -> float:
    """A pipeline stage's three buffers (forward inbox, backward inbox, stash), each of the
    schedule's capacity in microbatch inputs per virtual stage: all m for GPipe, at most p for
    1F1B; 0 without a pipeline."""
    if layout.stages == 1:
        return 0.0
    schedule = schedules.for_layout(layout)
    return 3 * layout.virtual_stages * schedule.capacity * microbatch_activation(model, layout)
