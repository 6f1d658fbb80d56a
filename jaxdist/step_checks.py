"""What a layout and its model must pass before a step is built (jaxdist.step.build): each
refusal one message, before anything is traced or compiled."""

import inspect

from flax import nnx
from jax.sharding import Mesh

from jaxdist.config import Layout, StepConfig
from jaxdist.errors import ConfigError
from jaxdist.kernels import fp8
from jaxdist.kernels.loss import Vocab
from jaxdist.parallel import context, pipeline, replica


def check_documents(abstract_model: nnx.Module, layout: Layout, vocab: Vocab) -> None:
    """Packed documents, and a sequence split over devices, need a model whose __call__ takes
    `docs` (the latter: each token's place in the row, jaxdist.parallel.context)."""
    params = inspect.signature(type(abstract_model).__call__).parameters
    takes = "docs" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    seq_axes = layout.seq_axes
    if not takes and layout.seq_ways > 1:
        raise ConfigError(
            f"{type(abstract_model).__name__} takes no `docs`, which carry each token's place "
            f"in the row when the sequence is split over {'x'.join(seq_axes)}; add "
            "`docs: jaxdist.kernels.documents.Documents | None = None` to its __call__, or use "
            "a mesh without a context axis"
        )
    if layout.step.document_mask and vocab.eos_id is not None:
        if not takes:
            raise ConfigError(
                f"{type(abstract_model).__name__} is called without document masks (its "
                "__call__ takes no `docs`), and this data packs documents; add "
                "`docs: jaxdist.kernels.documents.Documents | None = None` to it, or pass "
                "--no-document-mask (StepConfig(document_mask=False))"
            )


def pipeline_schedule(
    mesh: Mesh, config: StepConfig, abstract_params: nnx.State
) -> pipeline.Schedule | None:
    """The schedule over the `pipeline` axis, checked against the layers; None without one."""
    if "pipeline" not in mesh.shape or mesh.shape["pipeline"] <= 1:
        return None
    schedule = pipeline.make_schedule(
        config.pipeline_schedule,
        mesh.shape["pipeline"],
        config.microbatches,
        config.virtual_stages,
    )
    pipeline.check_layers(abstract_params, schedule)
    return schedule


def check(layout: Layout, mesh: Mesh) -> None:
    """Everything about the layout that can be wrong, before any shape is traced."""
    layout.step.validate()
    layout.rules.validate(mesh.axis_names)
    replica.check(layout)
    fp8.check(layout, mesh)
    if layout.mesh_shape != dict(mesh.shape):
        raise ConfigError(f"a layout for mesh {layout.mesh_shape} built on mesh {dict(mesh.shape)}")
    if layout.seq_len:
        context.balanced_order(layout.seq_len, layout.seq_ways)
    problem = layout.batch_problem()
    if problem:
        raise ConfigError(problem)
