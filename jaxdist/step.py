"""The train step: one pure function `train_step(state, batch) -> (state, metrics)`.

Stage 2 (compute forward/backward locally) and stage 4 (synchronize the update) of a step live
here. Stage 3 (move the tensors) is implicit: XLA inserts the collectives that the parameter
and batch shardings imply; jaxdist.planning.traffic reads them back out of the compiled program.

With --fp8 delayed the model holds its FP8 projections' scales and amax histories
(jaxdist.kernels.fp8.Fp8Meta). The state keeps them apart from the weights (`TrainState.fp8`),
so the optimizer, its clipping and weight decay, and the replica groups' outer step never see
them. The step differentiates both, and the "gradient" of the FP8 state is its new value
(Flax's overwrite-with-gradient), written into the state as it is, or kept where the step is
skipped as not finite. Over microbatches it is their max, not their sum or mean: each
microbatch starts from the same state, so they agree on every scale and on the history but its
newest amax, whose max over the microbatches is the whole batch's amax, what one microbatch of
the whole batch records (Flax's fm32 type adds by max for the same reason).

A router's selection bias (jaxdist.optim.ExpertBias) is a parameter no gradient reaches:
after the optimizer, the step moves it by the step's expert loads, which the model's aux gives.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist import optim
from jaxdist.errors import ConfigError
from jaxdist.kernels import documents, fp8
from jaxdist.kernels.loss import Vocab, model_loss, stage_loss
from jaxdist.layout import AxisRules, Layout, StepConfig
from jaxdist.model import param_count
from jaxdist.parallel import (
    collective_matmul,
    context,
    dropless,
    pipeline,
    replica,
    rounds,
    schedules,
)
from jaxdist.rules import activation_rules, batch_sharding, state_shardings


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: the number of updates applied so far
    params: nnx.State  # with replica groups: each group's own, [M, ...]
    opt_state: Any
    outer: Any = None  # with replica groups: their outer state (jaxdist.parallel.replica)
    fp8: Any = None  # --fp8 delayed: the FP8 scales and amax histories, not weights (above)


def forward_loss(
    model,
    tokens_BT1,
    vocab: Vocab,
    document_mask: bool,
    chunk_tokens: int = 0,
    train: bool = False,
):
    """Cross-entropy of next-token prediction over a batch of [B, T+1] tokens, and the model's
    auxiliary output. With packed documents (`document_mask` and an EOS id) the model gets
    their ids and positions; a sequence split over `context` is reordered for causal balance
    first (jaxdist.parallel.context). `train`: the step's loss, with what only training runs
    (multi-token prediction modules: jaxdist.kernels.loss.model_loss)."""
    eos = vocab.eos_id if document_mask else None
    inputs_BT, targets_BT, docs = context.inputs_and_targets(tokens_BT1, eos)
    return model_loss(model, inputs_BT, targets_BT, docs, vocab.size, chunk_tokens, train)


def _pipelined_grads(
    graphdef: nnx.GraphDef,
    state: TrainState,
    tokens_BT1: jax.Array,
    scale: jax.Array,
    config: StepConfig,
    schedule: pipeline.Schedule,
    vocab: Vocab,
):
    """(gradients, metrics) of the model's stages run pipelined over the microbatches."""
    stages = nnx.merge(graphdef, state.params).stages()
    eos = vocab.eos_id if config.document_mask else None
    loss, by_name, aux_loss = pipeline.value_and_grad(
        stages,
        tokens_BT1,
        stage_loss(stages, vocab, config.loss_chunk_tokens),
        scale,
        schedule,
        config.microbatches,
        eos_id=eos,
    )
    grads = jax.tree_util.tree_map_with_path(lambda path, _: by_name[path[0].key], state.params)
    return (grads, None), {"loss": loss, "aux_loss": aux_loss}


def _accumulated_grads(value_and_grad: Callable, inputs, tokens_BT1, scale, M: int):
    """((mean gradients, new FP8 state), mean metrics) over M microbatches run one after the
    other; `inputs`: (params, FP8 state or None). The FP8 state's max, as the module says."""
    B = tokens_BT1.shape[0]
    # Microbatch m takes rows m, m+M, ...: each device keeps its own rows, no reshuffle.
    micro_MBT1 = tokens_BT1.reshape(B // M, M, -1).swapaxes(0, 1)

    def accumulate(total, tokens_bT1):
        (_, extra), (grads, new_fp8) = value_and_grad(inputs, tokens_bT1, scale)
        # Scales and amaxes are >= 0, so the zeros below start the max.
        fp8_max = jax.tree.map(jnp.maximum, total[1], new_fp8)
        return (jax.tree.map(jnp.add, total[0], grads), fp8_max), extra

    zeros = jax.tree.map(jnp.zeros_like, inputs)
    (grad_sum, new_fp8), extras = jax.lax.scan(accumulate, zeros, micro_MBT1)
    extra = jax.tree.map(lambda v: jnp.mean(v, axis=0), extras)
    grads = jax.tree.map(lambda g: g / M, grad_sum)
    return (grads, new_fp8), extra


def _update(
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    state: TrainState,
    grads,
    extra: dict,
    new_fp8=None,
    bias_rates: dict | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The optimizer's update, skipped where the loss or gradients are not finite, and the
    step's metrics. `new_fp8`: the FP8 state's new value (--fp8 delayed), taken as it is, not
    a gradient, and kept out of the norm and the optimizer. `bias_rates`: the routers' biases
    to move by the loads in `extra` (jaxdist.optim.move_biases), by name."""
    loads = extra.pop("expert_load", {})
    loss = extra["loss"]
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A NaN/Inf loss or gradient skips the update: the old state is kept, on every device
    # alike (the check is on global values), without a host round trip.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, params, state.params)
    params = optim.move_biases(params, state.params, loads, bias_rates or {}, keep)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    # A skipped step keeps the old FP8 state too: its amaxes (NaN, Inf) would poison the
    # scales for a whole history.
    fp8_state = state.fp8 if new_fp8 is None else jax.tree.map(keep, new_fp8, state.fp8)
    # state.step counts batches consumed (the data position), skipped or not.
    new_state = state._replace(
        step=state.step + 1, params=params, opt_state=opt_state, fp8=fp8_state
    )
    count = optax.tree_utils.tree_get_all_with_path(state.opt_state, "count")[0][1]
    metrics = {**extra, "grad_norm": grad_norm, "finite": finite, "lr": lr_schedule(count)}
    return new_state, metrics


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    config: StepConfig,
    schedule: pipeline.Schedule | None = None,
    vocab: Vocab | None = None,
    bias_rates: dict | None = None,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds the pure step for one model structure, optimizer and accumulation setting;
    with a pipeline `schedule`, the model's stages run pipelined over the microbatches;
    `bias_rates`: the routers' biases it moves (jaxdist.optim.bias_rates)."""
    vocab = vocab or Vocab()

    def loss_fn(inputs: tuple, tokens_BT1: jax.Array, scale: jax.Array):
        # inputs: (params, FP8 state or None); their gradients come back as the same pair.
        model = nnx.merge(graphdef, *(s for s in inputs if s is not None))
        ce, aux = forward_loss(
            model, tokens_BT1, vocab, config.document_mask, config.loss_chunk_tokens, True
        )
        # The model's auxiliary losses (MoE balance, router z, multi-token prediction) join the
        # objective; the reported loss stays the next-token cross-entropy, comparable across
        # models (multi-token prediction's own: the mtp_loss metric).
        return (ce + aux["loss"]) * scale, {
            "loss": ce * scale,
            "aux_loss": aux["loss"],
            "expert_load": aux.get("expert_load", {}),
            **aux["metrics"],
        }

    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, tokens_BT1: jax.Array):
        faulty = jnp.isin(state.step, jnp.asarray(config.fault_nan_steps or (-1,)))
        scale = jnp.where(faulty, jnp.nan, 1.0)
        M, inputs = config.microbatches, (state.params, state.fp8)
        if schedule is not None:
            grads, extra = _pipelined_grads(
                graphdef, state, tokens_BT1, scale, config, schedule, vocab
            )
        elif M == 1:
            (_, extra), grads = value_and_grad(inputs, tokens_BT1, scale)
        else:
            grads, extra = _accumulated_grads(value_and_grad, inputs, tokens_BT1, scale, M)
        (grads, new_fp8) = grads
        return _update(tx, lr_schedule, state, grads, extra, new_fp8, bias_rates)

    return train_step


class JittedStep(NamedTuple):
    """The jitted functions the loop calls and what they were jitted for: the train step, the
    initial state maker, the held-out loss (`eval_fn(params, tokens_BT1) -> mean loss`), their
    shardings and the abstract state. jax compiles each on first use (or `compile_abstract`)."""

    step_fn: Callable
    init_fn: Callable[[], TrainState]
    state_sharding: TrainState
    batch_sharding: NamedSharding
    abstract_state: TrainState
    num_params: int
    eval_fn: Callable[[nnx.State, jax.Array], jax.Array]
    layout: Layout
    weights: Callable[[TrainState], nnx.State] = lambda state: state.params  # noqa: E731
    """the model's weights in a state, laid out as `eval_fn` takes them (with replica
    groups: the outer weights, as of the last outer step)"""
    start_fn: Callable[[nnx.State], TrainState] | None = None
    """the first state from given weights (shaped as `abstract_params`; consumed): a fresh
    optimizer state, and with replica groups every group starting from them"""

    def outer_part(self, step: int) -> "rounds.Action | None":
        """With replica groups, the part of the outer step step `step` runs beside its inner
        step (step_fn's third, static, argument); None: none."""
        sync = self.layout.sync
        return None if sync is None else rounds.action(sync, step)

    @property
    def abstract_params(self) -> nnx.State:
        """The model's weights, abstract (with replica groups: one group's, not [M, ...])."""
        state = self.abstract_state
        return state.params if state.outer is None else state.outer.params

    def compile_abstract(
        self, batch_shape: tuple[int, int] | None = None, act=None
    ) -> jax.stages.Compiled:
        """The step compiled ahead of time for abstract state and batch ([B, T+1] tokens; the
        layout's by default): XLA's program text, memory and cost analyses, with nothing
        allocated or run. `act`: with replica groups, the part of the outer step it runs."""
        if batch_shape is None:
            batch_shape = (self.layout.batch_size, self.layout.seq_len + 1)
        batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=self.batch_sharding)
        return self.step_fn.lower(self.abstract_state, batch, act).compile()


def _state_sharding(
    tx: optax.GradientTransformation,
    abstract_params: nnx.State,
    abstract_fp8: nnx.State | None,
    rules: AxisRules,
    mesh: Mesh,
) -> tuple[TrainState, Any]:
    """The train state's shardings (the optimizer's moments sharded like their parameters,
    its scalars replicated; the FP8 state by its own logical axes) and the optimizer's
    abstract state."""
    param_sharding = state_shardings(abstract_params, rules, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    # optax.partition (--optimizer muon) masks each part's state: the other part's parameters
    # are MaskedNodes there, and stay so.
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    opt_sharding = optax.tree_map_params(
        tx,
        lambda x, s: x if masked(x) else s,
        abstract_opt,
        param_sharding,
        transform_non_params=lambda _: replicated,
        is_leaf=masked,
    )
    fp8_sharding = None if abstract_fp8 is None else state_shardings(abstract_fp8, rules, mesh)
    return TrainState(replicated, param_sharding, opt_sharding, fp8=fp8_sharding), abstract_opt


def _abstract_state(shapes: TrainState, sharding: TrainState) -> TrainState:
    """Shapes, dtypes and shardings of the train state, nothing allocated."""

    def placed(a, s):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    return jax.tree.map(placed, shapes, sharding)


def check(layout: Layout, mesh: Mesh) -> None:
    """Everything about the layout that can be wrong, before any shape is traced: its
    settings, its rule table against the mesh, its own problems (jaxdist.layout), and what
    the devices refuse (FP8 before Hopper or on a TPU)."""
    layout.step.validate()
    layout.rules.validate(mesh.axis_names)
    if layout.mesh_shape != dict(mesh.shape):
        raise ConfigError(f"a layout for mesh {layout.mesh_shape} built on mesh {dict(mesh.shape)}")
    for problem in layout.problems()[:1]:
        raise ConfigError(problem.message)
    fp8.check(layout, mesh)


def _schedule_and_biases(layout: Layout, abstract_params):
    """The pipeline schedule (None without a pipeline), checked against the layers, and the
    routers' balancing biases the step moves (jaxdist.optim.bias_rates), which a pipeline's
    stages cannot move: they return no expert loads."""
    schedule = schedules.for_layout(layout)
    bias_rates = optim.bias_rates(abstract_params)
    if schedule is not None:
        pipeline.check_layers(abstract_params, schedule)
        if bias_rates:
            raise ConfigError(
                "aux-loss-free balancing (bias_update_rate) does not run under a pipeline: its "
                "stages return no expert loads; drop the pipeline axis or set the rate to 0"
            )
    return schedule, bias_rates


def build(
    init_model: Callable[[nnx.Rngs], nnx.Module],
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    layout: Layout,
    mesh: Mesh,
    seed: int = 0,
    vocab: Vocab | None = None,
) -> JittedStep:
    """Shapes, shardings and the jitted step of `layout` over `mesh`, checked before any
    compile. `vocab`: the data's vocabulary and EOS (from the data; default: raw bytes, no
    packing); the layout's `seq_len`, where known, is checked against a context split (else
    when the step traces)."""
    vocab = vocab or Vocab()
    config, rules = layout.step, layout.rules
    check(layout, mesh)
    # A replica axis of one group lays the batch out as a plain step does.
    tokens_sharding = batch_sharding(rules, mesh, layout.grouped and layout.replicas > 1)

    def built(at: Layout) -> nnx.Module:
        # Built under the layout: with --fp8 delayed the model holds its FP8 state.
        with activation_rules(at, mesh):
            return init_model(nnx.Rngs(seed))

    abstract_model = nnx.eval_shape(lambda: built(layout))
    documents.check_model(abstract_model, layout, vocab.eos_id)
    graphdef, abstract_fp8, abstract_params = _split(abstract_model)
    state_sharding, abstract_opt = _state_sharding(tx, abstract_params, abstract_fp8, rules, mesh)
    replicated = state_sharding.step
    param_sharding = state_sharding.params
    schedule, bias_rates = _schedule_and_biases(layout, abstract_params)
    step = make_train_step(graphdef, tx, lr_schedule, config, schedule, vocab, bias_rates)
    groups = layout.grouped

    def start(params) -> TrainState:
        # The FP8 state starts afresh (scales 1, empty histories) whatever the weights.
        fp8_state = None if abstract_fp8 is None else _split(built(layout))[1]
        if groups:
            first = replica.first_state(params, tx.init(params), layout.replicas)
            fp8_state = replica.stacked(fp8_state, layout.replicas)
            return TrainState(jnp.zeros((), jnp.int32), *first, fp8=fp8_state)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), fp8=fp8_state)

    def init() -> TrainState:
        return start(_split(built(layout))[2])

    weights = JittedStep._field_defaults["weights"]
    if groups:  # the fragments cut the layers, known now: SyncConfig's own check, with them
        layout.sync.validate(layout.replicas, replica.layers(abstract_params))
        where = replica.leaves(abstract_params, param_sharding, mesh, layout.sync.sync_fragments)
        state_sharding = replica.sharding(state_sharding, where, layout.sync, mesh)
        step = _grouped_step(step, layout, mesh, where)
        weights = jax.jit(lambda state: state.outer.params, out_shardings=param_sharding)
    init_fn = jax.jit(init, out_shardings=state_sharding)
    start_fn = jax.jit(start, out_shardings=state_sharding, donate_argnums=0)
    eval_fn = eval_function(init_model, layout, mesh, vocab, (param_sharding, tokens_sharding))

    def traced_step(state, batch, act=None):
        with activation_rules(layout, mesh):
            return step(state, batch, act) if groups else step(state, batch)

    metrics_sharding = replica.metrics_sharding(mesh) if groups else replicated
    step_fn = jax.jit(
        traced_step,
        in_shardings=(state_sharding, tokens_sharding),
        out_shardings=(state_sharding, metrics_sharding),
        donate_argnums=0,
        static_argnums=2,
        compiler_options=collective_matmul.compiler_options(
            mesh.devices.flat[0].platform, config.collective_matmul
        )
        | dropless.compiler_options(mesh.devices.flat[0].platform),
    )
    abstract_state = _abstract_state(jax.eval_shape(init), state_sharding)
    num_params = param_count(x.shape for x in jax.tree.leaves(abstract_params))
    return JittedStep(
        *(step_fn, init_fn, state_sharding, tokens_sharding, abstract_state, num_params),
        *(eval_fn, layout, weights, start_fn),
    )


def eval_function(
    init_model: Callable[[nnx.Rngs], nnx.Module],
    layout: Layout,
    mesh: Mesh,
    vocab: Vocab,
    in_shardings,
) -> Callable[[nnx.State, jax.Array], jax.Array]:
    """The held-out loss `eval_fn(params, tokens_BT1)`: the whole batch at once, no
    microbatches (the lookup weighs them), in the compute dtype (FP8 is how the step trains,
    not the model: its model holds no FP8 state). The one forward loss of both `build` and a
    run opened for use (jaxdist.inference.runs), which builds no step."""
    config = layout.step
    whole = dataclasses.replace(layout, step=dataclasses.replace(config, microbatches=1, fp8="off"))

    def built() -> nnx.Module:
        with activation_rules(whole, mesh):
            return init_model(nnx.Rngs(0))

    graphdef = nnx.split(nnx.eval_shape(built))[0]

    def eval_loss(params: nnx.State, tokens_BT1: jax.Array) -> jax.Array:
        with activation_rules(whole, mesh):
            model = nnx.merge(graphdef, params)
            return forward_loss(
                model, tokens_BT1, vocab, config.document_mask, config.loss_chunk_tokens
            )[0]

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(eval_loss, in_shardings=in_shardings, out_shardings=replicated)


def _split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State | None, nnx.State]:
    """(graphdef, FP8 state or None where the model holds none, parameters)."""
    graphdef, fp8_state, params = nnx.split(model, fp8.Fp8Meta, ...)
    return graphdef, fp8_state if jax.tree.leaves(fp8_state) else None, params


def _grouped_step(step, layout: Layout, mesh: Mesh, where):
    """The step of replica groups: each group's own step, and the outer step's parts that
    `act` (rounds.action) asks for around it."""
    inner = replica.inner_step(step, layout, mesh)

    def grouped_step(state: TrainState, tokens_BT1: jax.Array, act: rounds.Action | None):
        act = act or rounds.Action()
        return replica.outer_step(
            state, act, where, layout.sync, mesh, lambda s: inner(s, tokens_BT1)
        )

    return grouped_step
