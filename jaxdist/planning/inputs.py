"""What the planner is told: the model as it sees it (`PlanModel`: its weights in logical axes,
the activations it keeps for the backward pass, where its matmuls leave partial sums) and what to
plan for (`PlanConfig`). A model family supplies the first (models/inventory.py); the command
line, the second. Each layout the planner prices is a jaxdist.layout.Layout.
"""

import dataclasses
from collections.abc import Callable

from flax import nnx

from jaxdist.layout import SEARCHED_AXES, Layout, StepConfig, SyncConfig


@dataclasses.dataclass(frozen=True)
class Activation:
    """`count` tensors of this shape, whose dims carry these logical axes."""

    count: int
    logical: tuple[str | None, ...]
    shape: tuple[int, ...]
    dtype_bytes: int
    # A computation done in chunks (the fused cross-entropy's logits) holds one chunk at a
    # time: at most this many rows per device over all dims but the last (0: no chunks).
    chunk_rows: int = 0


@dataclasses.dataclass(frozen=True)
class Inventory:
    """What a model keeps alive for its backward pass, for one (micro)batch.

    saved_per_layer: saved by each layer under the model's remat policy;
    working: the extra a layer's backward needs while it runs (with remat, the part of the
      layer it rebuilds; without, buffers for the gradients of its activations);
    once: outside the layers (embedding output, final norm, logits).
    """

    saved_per_layer: tuple[Activation, ...]
    working: tuple[Activation, ...]
    once: tuple[Activation, ...]


@dataclasses.dataclass(frozen=True)
class PartialSum:
    """`count` times per step an activation [shape] with these logical axes is a partial sum
    over the split of logical axis `over` and must be all-reduced across it."""

    count: int
    logical: tuple[str, ...]
    shape: tuple[int, ...]
    over: str
    dtype_bytes: int
    kind: str = "all-reduce"  # or all-to-all: a buffer exchanged across the split of `over`


@dataclasses.dataclass(frozen=True)
class PlanModel:
    """What the planner needs of a model, declared in logical axes only."""

    name: str
    abstract_params: nnx.State
    num_layers: int
    seq_len: int
    d_model: int
    flops_per_token: float
    compute_bytes: int
    num_experts: int
    inventory: Callable[[int], Inventory]  # rows of one microbatch -> activations
    partial_sums: Callable[[Layout, str], list[PartialSum]]  # (layout, platform)
    # What its remat policy reruns in the backward pass (planning.compute.Work): a share of
    # each layer's forward weight matmuls, and attention's forward or not.
    recompute_matmul: float = 0.0
    recompute_attention: bool = False
    remat: str = ""  # the policy's name, for the plan's rows
    # The logical axes of the layer weights whose forward matmul the policy reruns in the
    # backward (the TPU compiler then gathers them once there: planning.traffic).
    reruns: frozenset[tuple] = frozenset()
    # MoE: each token's top_k experts, and the rows each multiplies per routed token: in
    # capacity mode every slot of the [E, C] buffers runs, filled or not, so the capacity
    # factor; dropless the grouped GEMMs run the routed rows, 1; 1 for dense models.
    top_k: int = 1
    expert_slots: float = 1.0


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What to plan: N devices of a hardware preset, a global batch, the step's settings as
    `jaxdist train` takes them (microbatches 1 on a pipelined layout: 4 per stage), and either
    every split over `axes` or one layout (`mesh`)."""

    devices: int
    hardware: str
    batch_size: int
    step: StepConfig = StepConfig()
    # The axes searched: all of them by default. A context split pays K/V traffic every layer,
    # priced here, so it ranks first only where it pays: rows too few to split over the
    # devices, or too long for their activations to fit.
    axes: tuple[str, ...] = SEARCHED_AXES
    compute_efficiency: float | None = None  # None: the hardware's calibrated rates
    max_layouts: int = 10
    mesh: tuple[tuple[str, int], ...] = ()  # price this one layout instead of enumerating
    # How replica groups meet, where a layout has a `replica` axis (`replica` in `axes`, or
    # `mesh`): DiLoCo, priced by planning.sync.
    sync: SyncConfig = SyncConfig()
    # Only this many replica groups where a layout has any (0: any number `axes` allows).
    replicas: int = 0
    # The slow link (hardware `outer`: between hosts or slices) at this many Gbit/s per device
    # instead of the preset's; None: the preset's.
    link_gbps: float | None = None
