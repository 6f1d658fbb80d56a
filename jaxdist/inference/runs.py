"""A trained run opened for use (`jaxdist eval`, `generate`, `export-hf`, a run as a Hugging
Face source): its record, its model, and one checkpoint's weights on a mesh of the devices at
hand, with no optimizer and no train step built.

Only the weights are read from the checkpoint (Orbax's partial restore), verified against
their entries of the fingerprint saved with it: a run of replica groups gives its outer
weights, which are the model (read on any mesh: the groups do not matter here); an `--fp8
delayed` run's FP8 state is how it trained, not the model, and stays unread. The node-local
tier is not read: a finished run removed it, and a stopped run's newest persistent checkpoint
is what is opened.
"""

import json
import pathlib
from typing import NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxdist.checkpoint.store import Checkpointer, Part, param_shapes
from jaxdist.errors import ConfigError
from jaxdist.kernels.loss import Vocab
from jaxdist.layout import REPLICA, AxisRules, Layout, StepConfig
from jaxdist.model import ModelSpec
from jaxdist.parallel.replica import OuterState
from jaxdist.rules import activation_rules, batch_sharding, state_shardings
from jaxdist.step import TrainState, eval_function


def read_record(run_dir: pathlib.Path, other: str = "") -> dict:
    """The run's config.json, or one line saying it is not a run directory (`other`: the
    other sources the caller takes, for the fix)."""
    try:
        return json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{run_dir}/config.json is missing or unreadable ({e}); pass a run directory made by "
            f"jaxdist train{other}"
        ) from None


class Forward(NamedTuple):
    """The held-out loss of an opened run's weights, as jaxdist.evaluation.evaluate runs it."""

    eval_fn: object  # (params, tokens_BT1) -> mean loss, jitted
    batch_sharding: NamedSharding


class OpenRun(NamedTuple):
    """A trained run, one checkpoint's weights on a mesh."""

    run_dir: pathlib.Path
    record: dict  # its config.json
    spec: ModelSpec
    params: nnx.State  # the model's weights (a replica run's: the outer ones), on `mesh`
    step: int  # the checkpoint's
    mesh: Mesh
    rules: AxisRules

    def by_name(self) -> dict:
        """The weights as name -> global array (a Hugging Face adapter's names)."""
        flat = jax.tree_util.tree_flatten_with_path(self.params)[0]
        return {path[0].key: x for path, x in flat}

    def forward(self, vocab: Vocab, batch_size: int) -> Forward:
        """The run's own held-out loss (the loss function of its train step, jaxdist.step
        .eval_function, with the step settings it trained with) over batches of `batch_size`
        rows of `vocab`'s data."""
        recorded = self.record.get("step") or {}
        step_cfg = StepConfig(
            document_mask=recorded.get("document_mask", True),
            **StepConfig.recorded_state(recorded),
        )
        layout = Layout.on(
            self.mesh, self.rules, step_cfg, batch_size=batch_size, seq_len=self.spec.seq_len
        )
        problem = layout.batch_problem()
        if problem:
            raise ConfigError(problem)
        tokens = batch_sharding(self.rules, self.mesh)
        shardings = jax.tree.map(lambda x: x.sharding, self.params)
        eval_fn = eval_function(self.spec.init, layout, self.mesh, vocab, (shardings, tokens))
        return Forward(eval_fn, tokens)


def open_run(
    run_dir: pathlib.Path, spec: ModelSpec, mesh: Mesh, rules: AxisRules, step: int | None = None
) -> OpenRun:
    """The run in `run_dir` with the weights of its checkpoint of `step` (default: the newest
    that reads and verifies) on `mesh` as `rules` lay them out. `spec`: the model its record
    names (models' from_record: the library never imports models/)."""
    record = read_record(run_dir)
    directory = run_dir / "checkpoints"
    none = ConfigError(
        f"{run_dir} holds no checkpoint; train it first (jaxdist train --run-dir {run_dir})"
    )
    if not directory.is_dir():
        raise none
    params = _abstract_params(spec, mesh, rules)
    groups = (record.get("mesh") or {}).get(REPLICA, 1) if record.get("sync") else 0
    checkpointer = Checkpointer(directory)
    try:
        have = checkpointer.steps()
        if not have:
            raise none
        if step is not None and step not in have:
            raise ConfigError(f"{run_dir} holds no checkpoint of step {step}; it has {have}")
        restored = checkpointer.restore_latest(
            _weights_part(params, groups),
            _saved_shapes(params, groups),
            None if step is None else [step],
        )
    finally:
        checkpointer.close()
    if restored is None:
        raise ConfigError(
            f"{run_dir} holds no valid checkpoint (all were set aside as damaged: "
            f"jaxdist checkpoints {run_dir} lists them)"
        )
    weights = restored.state["outer"]["params"] if groups else restored.state["params"]
    return OpenRun(run_dir, record, spec, weights, restored.step, mesh, rules)


def _abstract_params(spec: ModelSpec, mesh: Mesh, rules: AxisRules) -> nnx.State:
    """The model's weights, abstract, each with the sharding `rules` give it on `mesh`; built
    as the train step builds them (under a layout, without FP8 state)."""
    with activation_rules(Layout.on(mesh, rules), mesh):
        shapes = nnx.state(nnx.eval_shape(lambda: spec.init(nnx.Rngs(0))))
    shardings = state_shardings(shapes, rules, mesh)

    def placed(a, s):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    return jax.tree.map(placed, shapes, shardings)


def _weights_part(params: nnx.State, groups: int) -> Part:
    """The weights of a saved TrainState: its params, or with replica groups (`groups` > 0)
    the outer weights (each group's params are [M, ...], its own as of its last step)."""
    path = ("outer", "params") if groups else ("params",)

    def first(saved: dict) -> int:
        # The state's leaves come in its fields' order (TrainState's, then OuterState's):
        # count those of the fields before each step of the path.
        count, tree = 0, saved
        for key, kind in zip(path, (TrainState, OuterState), strict=False):
            fields = kind._fields
            count += sum(len(jax.tree.leaves(tree[f])) for f in fields[: fields.index(key)])
            tree = tree[key]
        return count

    tree = {"outer": {"params": params}} if groups else {"params": params}
    return Part(tree, first)


def _saved_shapes(params: nnx.State, groups: int) -> dict[str, list[int]]:
    """The parameter shapes its checkpoints record (with replica groups: [M, ...] each)."""
    shapes = param_shapes(params)
    return {k: [groups, *v] for k, v in shapes.items()} if groups else shapes
