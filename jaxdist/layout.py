"""How one step lays out over a mesh, in plain values: the mesh's axis names, the rule table
from the models' logical axes onto them, the step's and the replica groups' settings, and the
`Layout` that holds them and answers, once, what every room asks of it (`problems` among them).

Low in the house on purpose: no jax, no parallel/, no planner. The planner, the step, the
kernels, the CLI's flags and a run's record read one Layout, and a flag parses without jax.
"""

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple, get_args

from jaxdist.errors import ConfigError
from jaxdist.model import LOGICAL_AXES

# Outermost first: slow links (pipeline stages across racks, data across hosts) outside,
# fast links (tensor) innermost; context (K/V exchanged every layer) and expert all-to-all
# traffic sit on fast links too. `replica` is outermost of all: groups that train alone and
# meet only every H steps (jaxdist.parallel.replica) belong across the slowest link.
REPLICA = "replica"
MESH_AXES: tuple[str, ...] = (REPLICA, "pipeline", "data", "fsdp", "context", "expert", "tensor")
# The axes a layout is searched over by default: every one but `replica`, whose groups change
# what is computed (DiLoCo), not only where; the planner ranks it when asked.
SEARCHED_AXES: tuple[str, ...] = tuple(a for a in MESH_AXES if a != REPLICA)

# Each setting's choices, listed once (parallel/ and the flags read them with typing.get_args).
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved"]
ContextStrategy = Literal["all-gather", "ring", "ulysses"]
CollectiveMatmul = Literal["one-way", "two-way"]
Fp8Recipe = Literal["off", "current", "delayed"]
Fp8Filter = Literal["auto", "none"]
SyncDtype = Literal["float32", "bfloat16", "float8", "int8"]
OuterMemory = Literal["device", "host"]
AUTO = "auto"  # an outer step left to the run (jaxdist.parallel.rounds.outer_choice)


def check_choice(flag: str, value: str, choices) -> None:
    """One message for a value outside a Literal type's choices."""
    options = get_args(choices)
    if value not in options:
        *most, last = options
        raise ConfigError(f"{flag} {value!r}: choose from {', '.join(most)} or {last}")


def spec(shape) -> str:
    """Mesh sizes ({axis: size}) as --mesh takes them, the size-1 axes left out."""
    return ",".join(f"{a}={n}" for a, n in dict(shape).items() if n > 1) or "single"


MeshAxes = str | tuple[str, ...] | None


def as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def ways(mesh_shape: Mapping[str, int], axes: Iterable[str]) -> int:
    """How many devices a split over these mesh axes spreads a dimension across."""
    return math.prod(mesh_shape.get(a, 1) for a in axes)


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Rows of (logical axis, mesh axes for parameters, mesh axes for activations), which
    jaxdist.rules resolves to shardings: FSDP splits a weight's `embed` and a batch over `fsdp`."""

    rows: tuple[tuple[str, MeshAxes, MeshAxes], ...]

    def mesh_axes(self, logical: str, kind: str) -> tuple[str, ...]:
        for name, param_axes, act_axes in self.rows:
            if name == logical:
                return as_tuple(param_axes if kind == "param" else act_axes)
        raise ConfigError(
            f"logical axis {logical!r} has no rule; add a row for it to the mesh preset's table"
        )

    def validate(self, mesh_axis_names: tuple[str, ...]) -> None:
        """Raises ConfigError for unknown, repeated or missing names and unknown mesh axes."""
        seen: set[str] = set()
        for row in self.rows:
            if len(row) != 3:
                raise ConfigError(f"rule row {row!r} must be (logical, param_axes, act_axes)")
            name = row[0]
            if name not in LOGICAL_AXES:
                raise ConfigError(
                    f"rule table names unknown logical axis {name!r}; known: {LOGICAL_AXES}"
                )
            if name in seen:
                raise ConfigError(
                    f"logical axis {name!r} appears twice in the rule table; keep one row"
                )
            seen.add(name)
            for kind, axes in (("param", row[1]), ("activation", row[2])):
                axes_t = as_tuple(axes)
                for axis in axes_t:
                    if axis not in mesh_axis_names:
                        raise ConfigError(
                            f"rule for {name!r} ({kind}) names mesh axis {axis!r}, which the "
                            f"mesh lacks; mesh axes are {mesh_axis_names}"
                        )
                if len(set(axes_t)) != len(axes_t):
                    raise ConfigError(f"rule for {name!r} ({kind}) repeats a mesh axis: {axes_t}")
        missing = [n for n in LOGICAL_AXES if n not in seen]
        if missing:
            raise ConfigError(
                f"rule table has no row for logical axes {missing}; write them out, "
                "with None where they stay replicated"
            )

    def spec(self, logical: tuple[str | None, ...], kind: str, what: str = "array"):
        """The PartitionSpec for a tensor whose dims carry these logical names. A name given
        twice (a [T, T] table as ("seq", "seq")) is split on its first dim only: the second
        indexes the whole of it, as attention's keys do for its queries."""
        from jax.sharding import PartitionSpec  # only what shards pays for jax

        entries: list[tuple[str, ...] | None] = []
        used: dict[str, str] = {}
        for d, dim_name in enumerate(logical):
            again = dim_name in logical[:d]
            axes = () if dim_name is None or again else self.mesh_axes(dim_name, kind)
            for axis in axes:
                if axis in used:
                    raise ConfigError(
                        f"{what}: mesh axis {axis!r} would split both {used[axis]!r} and "
                        f"{dim_name!r}; change the rule table so one of them uses another axis"
                    )
                used[axis] = dim_name
            entries.append(axes if axes else None)
        return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    microbatches: int = 1
    """gradient accumulation: the batch is run as this many slices per step (with a pipeline
    axis: the microbatches the schedule pipelines)"""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """schedule over the pipeline mesh axis: gpipe (every microbatch's forward, then every
    backward: all their activations held), 1f1b (one forward, one backward in turn: at most a
    stage count of microbatches' activations held), interleaved (1f1b over --virtual-stages
    chunks of layers per device: a smaller idle bubble for more sends)"""
    virtual_stages: int = 1
    """layer chunks per device for the interleaved schedule"""
    document_mask: bool = True
    """with tokenized data: attention stays inside each packed document and positions restart
    at each (off: a row is one causal sequence)"""
    loss_chunk_tokens: int = 2048
    """fused cross-entropy: the sequence is cut into chunks of at most this many tokens per
    device, whose fp32 logits (tokens x vocab x 4 bytes) are the most held at once; fewer
    where those would pass 512 MiB (1024 at Llama 3's 128K vocabulary: 0.5 GB;
    jaxdist.kernels.fused_loss.chunk_tokens_for); 0: the whole logits, as the model returns
    them"""
    context_strategy: ContextStrategy = "all-gather"
    """how attention crosses a sequence split over the `context` mesh axis
    (jaxdist.parallel.context)"""
    collective_matmul: CollectiveMatmul = "one-way"
    """TPU: how the compiler streams an FSDP weight through its matmuls, each shard once round
    the ring or both ways (XLA's default: 2n + 1 shards of 1/n per use against n - 1, about
    twice a step's bytes); jaxdist.parallel.collective_matmul"""
    fp8: Fp8Recipe = "off"
    """FP8 GEMMs for the attention and MLP projections (Hopper): operands in e4m3, gradients in
    e5m2, one scale per tensor, from the tensor itself (current) or from an amax history kept
    in the checkpointed state (delayed); off: the compute dtype. Emulated on the CPU; refused
    on TPUs and with a pipeline axis"""
    fp8_history: int = 16
    """--fp8 delayed: steps of amax history a scale is taken from"""
    fp8_filter: Fp8Filter = "auto"
    """auto: projections too small to gain stay in the compute dtype
    (jaxdist.kernels.fp8.worth_fp8); none: every projection in FP8"""
    fault_nan_steps: tuple[int, ...] = ()
    """fault injection, for testing recovery: make these steps' loss and gradients NaN"""

    @staticmethod
    def recorded_state(step: dict) -> dict:
        """The settings of a run's recorded `step` (config.json) that shape its train state,
        to read its checkpoints: --fp8 delayed's (its FP8 state); {} for every other run."""
        if step.get("fp8") != "delayed":
            return {}
        return {k: step[k] for k in ("fp8", "fp8_history", "fp8_filter") if k in step}

    def validate(self) -> None:
        if self.microbatches < 1:
            raise ConfigError(f"--microbatches {self.microbatches} must be at least 1")
        if self.virtual_stages < 1:
            raise ConfigError(f"--virtual-stages {self.virtual_stages} must be at least 1")
        if self.loss_chunk_tokens < 0:
            raise ConfigError(
                f"--loss-chunk-tokens {self.loss_chunk_tokens} must be >= 0 (0: unfused)"
            )
        check_choice("--pipeline-schedule", self.pipeline_schedule, PipelineSchedule)
        check_choice("--context-strategy", self.context_strategy, ContextStrategy)
        check_choice("--collective-matmul", self.collective_matmul, CollectiveMatmul)
        check_choice("--fp8", self.fp8, Fp8Recipe)
        check_choice("--fp8-filter", self.fp8_filter, Fp8Filter)
        if self.fp8_history < 1:
            raise ConfigError(f"--fp8-history {self.fp8_history} must be at least 1")
        if self.virtual_stages > 1 and self.pipeline_schedule != "interleaved":
            raise ConfigError(
                f"--virtual-stages {self.virtual_stages} applies to the interleaved schedule; "
                "add --pipeline-schedule interleaved"
            )


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """How the groups of a `replica` mesh axis meet (DiLoCo, jaxdist.parallel.replica): each
    trains alone on its block of every batch, and every `sync_every` steps an outer Nesterov
    step moves the shared weights by the groups' mean change."""

    sync_every: int = 32
    """H in the DiLoCo papers: inner steps between two outer steps (of each fragment), each
    group training alone meanwhile"""
    outer_lr: float | Literal["auto"] = AUTO
    """the outer Nesterov step's lr; auto: plain averaging (lr 1, momentum 0) for H below 30 or
    fewer than 100 syncs left in the run, else DiLoCo's tuned 0.7 with momentum 0.9 (the
    run's header says which; a resume keeps its start's choice)"""
    outer_momentum: float | Literal["auto"] = AUTO
    """the outer step's Nesterov momentum (torch.optim.SGD(nesterov=True)); 0: plain SGD;
    auto: as --outer-lr auto chooses"""
    sync_fragments: int = 1
    """F in Streaming DiLoCo: the layers in F strided groups (layer l in group l % F), one
    synced every --sync-every / F steps in turn; the other weights go with group 0"""
    sync_delay: int = 0
    """T in Streaming DiLoCo: inner steps a fragment's exchange overlaps before it is applied
    (0: at once); the groups then mix the new weights with what they learnt meanwhile
    (--sync-mix)"""
    sync_mix: float = 0.5
    """with --sync-delay: the share of the outer weights in each group's new weights"""
    outer_memory: OuterMemory = "device"
    """where the outer state (weights and momentum) lives between outer steps: host memory
    frees the device of it, for a copy in and out at each outer step"""
    sync_dtype: SyncDtype = "float32"
    """the type the exchange travels in: float32 and bfloat16 send the weights, the 8-bit
    types the change since the last outer step with a float32 scale per row (each group then
    keeps the outer weights: 4 bytes a parameter more); summed in float32"""

    def changed_flags(self) -> list[str]:
        """The flags of the settings given other than their defaults (--sync-every, ...)."""
        return [
            "--" + f.name.replace("_", "-")
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]

    def validate(self, replicas: int, layers: int | None = None) -> None:
        H, F, T = self.sync_every, self.sync_fragments, self.sync_delay
        if H < 1:
            raise ConfigError(f"--sync-every {H} must be at least 1 (steps between outer steps)")
        if F < 1 or H % F:
            raise ConfigError(
                f"--sync-fragments {F} must divide --sync-every {H}: each fragment's turn is "
                "H/F steps"
            )
        if layers is not None and layers % F:
            raise ConfigError(
                f"--sync-fragments {F} does not divide the model's {layers} layers; use a "
                f"divisor of {layers}"
            )
        if not 0 <= T < H // F:
            raise ConfigError(
                f"--sync-delay {T} must be shorter than a fragment's turn (H/F = {H // F} "
                f"steps): 0 to {H // F - 1}"
            )
        if self.outer_lr != AUTO and not 0 < self.outer_lr:
            raise ConfigError(f"--outer-lr {self.outer_lr} must be > 0 (or auto)")
        if self.outer_momentum != AUTO and not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum {self.outer_momentum} must be in [0, 1) (or auto)")
        if not 0 < self.sync_mix <= 1:
            raise ConfigError(f"--sync-mix {self.sync_mix} must be in (0, 1]")
        check_choice("--sync-dtype", self.sync_dtype, SyncDtype)
        check_choice("--outer-memory", self.outer_memory, OuterMemory)
        if replicas < 1:
            raise ConfigError(f"replica={replicas} must be at least 1")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one step lays out over a mesh: its axis sizes, the rule table that maps logical axes
    onto them, the step's settings, the remat policy and the batch's shape. It answers once
    what every part of the step asks of it: how many devices share the batch or the sequence,
    and the rows of a microbatch."""

    sizes: tuple[tuple[str, int], ...]
    """mesh axis sizes, outermost first (MESH_AXES)"""
    rules: AxisRules
    step: StepConfig = StepConfig()
    remat: str = ""
    """the model's rematerialization policy (models/remat.py); "": the model's own"""
    batch_size: int = 0
    """global rows per step (0: not known here, as in generation)"""
    seq_len: int = 0
    """tokens per row (0: not known here)"""
    sync: SyncConfig | None = None
    """the replica groups' outer step (DiLoCo); None: every step reduces every gradient"""
    in_group: bool = False
    """traced as one replica group's step (mapped over the `replica` axis)"""

    @classmethod
    def on(cls, mesh, rules: AxisRules, step: StepConfig = StepConfig(), **fields) -> "Layout":
        """The layout of a step over this mesh (a jax Mesh or AbstractMesh)."""
        return cls(tuple(mesh.shape.items()), rules, step, **fields)

    @functools.cached_property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def devices(self) -> int:
        return math.prod(n for _, n in self.sizes)

    @property
    def replicas(self) -> int:
        """M: groups that train alone between outer steps (the `replica` axis)."""
        return self.mesh_shape.get(REPLICA, 1)

    @property
    def stages(self) -> int:
        return self.mesh_shape.get("pipeline", 1)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes that split a batch's rows."""
        return self.rules.mesh_axes("batch", "activation")

    @property
    def seq_axes(self) -> tuple[str, ...]:
        """The mesh axes that split a row's tokens (context parallelism)."""
        return self.rules.mesh_axes("seq", "activation")

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Every mesh axis that splits a step's tokens: the batch's, then the sequence's."""
        return self.batch_axes + self.seq_axes

    @property
    def batch_ways(self) -> int:
        return ways(self.mesh_shape, self.batch_axes)

    @property
    def seq_ways(self) -> int:
        return ways(self.mesh_shape, self.seq_axes)

    @property
    def microbatches(self) -> int:
        return self.step.microbatches

    @property
    def micro_rows(self) -> int:
        """Global rows of one microbatch."""
        return self.batch_size // self.step.microbatches

    @property
    def virtual_stages(self) -> int:
        """Layer chunks per device: the interleaved schedule's, else 1."""
        interleaved = self.step.pipeline_schedule == "interleaved"
        return self.step.virtual_stages if interleaved else 1

    def describe(self) -> str:
        """The mesh as `--mesh` takes it (fsdp=2,context=4), its size-1 axes left out."""
        return spec(self.sizes)

    @property
    def grouped(self) -> bool:
        """Whether replica groups train apart and meet every H steps (the whole layout of
        them; a group's own layout is not grouped)."""
        return self.sync is not None and not self.in_group

    @property
    def batch_unit(self) -> int:
        """The smallest global batch this layout splits: a row per device of the batch axes
        per microbatch, in every replica group."""
        groups = self.replicas if self.grouped else 1
        return groups * self.batch_ways * self.step.microbatches

    def group(self) -> "Layout":
        """One replica group's layout as the program traces it: its block of the batch, the
        groups' axis kept for jaxdist.parallel.replica to map the step over."""
        return dataclasses.replace(self, batch_size=self.batch_size // self.replicas, in_group=True)

    def group_alone(self) -> "Layout":
        """One replica group as if it were the whole job, as the planner prices its inner
        step: the `replica` axis at 1, the group's block of the batch, no outer step."""
        sizes = tuple((a, 1 if a == REPLICA else n) for a, n in self.sizes)
        rows = self.batch_size // self.replicas
        return dataclasses.replace(self, sizes=sizes, batch_size=rows, sync=None, in_group=False)

    def batch_problem(self) -> str | None:
        """Why the batch cannot be split into its microbatches over the batch axes, or None."""
        if self.grouped:
            M = self.replicas
            if self.batch_size % M:
                return (
                    f"batch size {self.batch_size} does not split into the {M} replica groups' "
                    f"blocks; use a multiple of {M}"
                )
            return self.group().batch_problem()
        m, n = self.step.microbatches, self.batch_ways
        if self.batch_size % m:
            return f"batch size {self.batch_size} is not divisible by {m} microbatches"
        if self.micro_rows % n:
            return (
                f"microbatch of {self.micro_rows} rows (batch {self.batch_size} / {m} "
                f"microbatches) does not split over the {n} devices of the batch axes "
                f"{'x'.join(self.batch_axes)}; use a batch size that is a multiple of {n * m}"
            )
        return None

    def problems(self, layers: int | None = None) -> list["Problem"]:
        """Everything that keeps this layout from running, known without a model's weights
        or a device; [] if none. `layers`: the model's, where known (sync fragments must
        divide them). The step refuses with the first (jaxdist.step.build); the planner drops
        the layout, counted by kind (planning/layouts.why_not). The pipeline schedule's own
        rules are its builder's (jaxdist.parallel.schedules), which both call."""
        M, p = self.replicas, self.stages
        out = []
        if self.sync is None and M > 1:
            out.append(Problem(
                "replica groups without sync settings",
                f"mesh replica={M} trains {M} groups apart; they need the outer step's settings "
                "(the CLI gives --sync-every and the rest defaults; in Python pass "
                "Layout(..., sync=SyncConfig()))",
            ))  # fmt: skip
        if self.sync is not None:
            try:
                self.sync.validate(M, layers)
            except ConfigError as e:
                out.append(Problem("sync settings", str(e)))
        if self.batch_size and (problem := self.batch_problem()):
            out.append(Problem("batch", problem))
        cp, T = self.seq_ways, self.seq_len
        if cp > 1 and T and T % (2 * cp):
            out.append(Problem(
                "sequence not a multiple of 2 x context",
                f"context parallelism over {cp} devices cuts the sequence into {2 * cp} equal "
                f"chunks (two per device, for causal balance); --seq-len {T} is not a multiple "
                f"of {2 * cp}: use --seq-len {max(2 * cp, T // (2 * cp) * 2 * cp)}",
            ))  # fmt: skip
        if p > 1 and self.step.fp8 != "off":
            out.append(Problem(
                "a pipeline axis with --fp8",
                f"--fp8 {self.step.fp8} with pipeline={p}: the stages run in a shard_map that "
                "holds each device's own rows, so a tensor's amax would be one device's, and "
                "the pipeline's schedule does not carry the delayed state; drop the pipeline "
                "axis (fsdp/data/tensor instead) or use --fp8 off",
            ))  # fmt: skip
        return out


class Problem(NamedTuple):
    """Why a layout cannot run: a short kind the planner counts layouts by, and the message
    a user reads, naming the fix."""

    kind: str
    message: str
