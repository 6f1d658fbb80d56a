"""A run's configuration, as frozen values: one config per component the loop owns (the step,
the loop, evaluation), the `RunConfig` that gathers them with the components' own (optimizer,
data, checkpoints, replica groups), and the `Layout`: how one step lays out over a mesh.

A run records all of it (config.json); the planner enumerates Layouts, `train` builds one, and
the step is traced under one (jaxdist.rules.activation_rules).
"""

import dataclasses
import functools
import math
from typing import Annotated, Literal

import tyro

from jaxdist import hardware
from jaxdist.checkpoint.interval import CheckpointConfig
from jaxdist.checkpoint.recovery import NonFinitePolicy
from jaxdist.cluster import faults as fault_injection
from jaxdist.data.batches import DataConfig
from jaxdist.errors import ConfigError
from jaxdist.mesh import spec
from jaxdist.metrics import wandb_log
from jaxdist.optim import OptimConfig
from jaxdist.parallel import collective_matmul
from jaxdist.parallel.context import STRATEGIES
from jaxdist.parallel.rounds import SyncConfig
from jaxdist.profiling.capture import parse_range
from jaxdist.rules import AxisRules, ways


@dataclasses.dataclass(frozen=True)
class StepConfig:
    microbatches: int = 1
    """gradient accumulation: the batch is run as this many slices per step (with a pipeline
    axis: the microbatches the schedule pipelines)"""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """schedule over the pipeline mesh axis"""
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
    context_strategy: Literal["all-gather", "ring", "ulysses"] = "all-gather"
    """how attention crosses a sequence split over the `context` mesh axis
    (jaxdist.parallel.context)"""
    collective_matmul: Literal["one-way", "two-way"] = "one-way"
    """TPU: how the compiler streams an FSDP weight through its matmuls, each shard once round
    the ring or both ways (XLA's default: 2n + 1 shards of 1/n per use against n - 1, about
    twice a step's bytes); jaxdist.parallel.collective_matmul"""
    fp8: Literal["off", "current", "delayed"] = "off"
    """FP8 GEMMs for the attention and MLP projections (Hopper): operands in e4m3, gradients in
    e5m2, one scale per tensor, from the tensor itself (current) or from an amax history kept
    in the checkpointed state (delayed); off: the compute dtype. Emulated on the CPU; refused
    on TPUs and with a pipeline axis"""
    fp8_history: int = 16
    """--fp8 delayed: steps of amax history a scale is taken from"""
    fp8_filter: Literal["auto", "none"] = "auto"
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
        if self.context_strategy not in STRATEGIES:
            raise ConfigError(
                f"--context-strategy {self.context_strategy!r}: choose from {', '.join(STRATEGIES)}"
            )
        collective_matmul.check(self.collective_matmul)
        if self.fp8_history < 1:
            raise ConfigError(f"--fp8-history {self.fp8_history} must be at least 1")
        if self.virtual_stages > 1 and self.pipeline_schedule != "interleaved":
            raise ConfigError(
                f"--virtual-stages {self.virtual_stages} applies to the interleaved schedule; "
                "add --pipeline-schedule interleaved"
            )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    eval_every: int | None = None
    """evaluate every N steps and at the end; default: at the end when the data has an eval
    split; 0: never"""
    eval_batches: int = 20
    """fixed batches per evaluation (the same ones each time)"""
    eval_data: str | None = None
    """held-out data (a tokenized directory: its eval split, else all of it); default: the
    training data's eval split"""

    def validate(self) -> None:
        if self.eval_every is not None and self.eval_every < 0:
            raise ConfigError(f"--eval-every {self.eval_every} must be >= 0 (0: never)")
        if self.eval_batches < 1:
            raise ConfigError(f"--eval-batches {self.eval_batches} must be at least 1")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    steps: int = 300
    """steps the run trains to (a resumed run continues to it)"""
    log_every: int = 10
    """steps between logged records (metrics.jsonl, TensorBoard, the console; its "time left"
    is the steps left at the recent median step time, evaluations and saves not counted)"""
    run_dir: str | None = None
    """directory for config.json, metrics.jsonl, summary.json, checkpoints (none: a new
    runs/<time>); pass the same one again to resume"""
    peak_tflops: float | None = None
    """peak TFLOP/s per device for MFU, where the device kind is not known"""
    seed: int = 0
    """seeds the model's initial weights and the data's order"""
    nonfinite: NonFinitePolicy = "skip"
    """on a NaN/Inf loss or gradient: skip the update, roll back to the last checkpoint and
    skip past the batch, or stop"""
    profile: str | None = None
    """START:STOP: trace these steps and write the step-time breakdown to the run dir"""
    watch_comm: float | None = None
    """warn when exposed communication or sync passes this fraction of a step (profiles a
    few steps every --watch-every steps)"""
    watch_every: int = 100
    """steps between --watch-comm's profiles"""
    hardware: str = "auto"
    """cost-model preset for profile reports (jaxdist.hardware); auto: the devices' own"""
    slow_step_factor: float = 10.0
    """report a step slower than this many times the p50 step, naming lagging processes"""
    hang_timeout: float | None = None
    """seconds without a finished step after which the run is declared hung: the stuck
    processes are named, their stacks logged, and every process exits 124 (default: the larger
    of 600 s and 20 x the p50 step; 0: off)"""
    term_grace: float = 60.0
    """after SIGTERM or SIGINT, seconds to reach the next step boundary and save; past them
    the process exits 143 without saving (0: wait forever)"""
    fault: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """fault injection, for tests and the chaos study: KIND:STEP:PROCESS[:SECONDS], KIND one of
    kill, stall (with SECONDS), term, restore-error, disk-full; each fires once per run;
    repeat the flag for several"""
    fault_stall: str | None = None
    """fault injection, for testing the watchdog: STEP:PROCESS:SECONDS to stall (the same as
    --fault stall:STEP:PROCESS:SECONDS)"""
    wandb: str | None = None
    """also log the TensorBoard scalars to this Weights & Biases project (pip install
    'jaxdist[wandb]'); offline, into RUN_DIR/wandb, without an API key; a resumed run
    continues its W&B run"""
    wandb_entity: str | None = None
    """the W&B team or user to log under (none: the API key's own)"""

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps {self.steps} must be at least 1")
        if self.log_every < 1:
            raise ConfigError(f"--log-every {self.log_every} must be at least 1")
        if self.nonfinite not in ("skip", "rollback", "stop"):
            raise ConfigError(f"--nonfinite {self.nonfinite!r}: use skip, rollback or stop")
        if self.watch_every < 1:
            raise ConfigError(f"--watch-every {self.watch_every} must be at least 1")
        if self.watch_comm is not None and not 0 < self.watch_comm < 1:
            raise ConfigError(f"--watch-comm {self.watch_comm} is a fraction of a step: (0, 1)")
        if not self.slow_step_factor > 1:
            raise ConfigError(f"--slow-step-factor {self.slow_step_factor} must be > 1")
        if self.hang_timeout is not None and self.hang_timeout < 0:
            raise ConfigError(f"--hang-timeout {self.hang_timeout} must be >= 0 (0: off)")
        if self.term_grace < 0:
            raise ConfigError(f"--term-grace {self.term_grace} must be >= 0 (0: wait forever)")
        for fault in self.faults():
            fault_injection.parse(fault)
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"--peak-tflops {self.peak_tflops} must be > 0")
        if self.profile:
            start, stop = parse_range(self.profile)
            if stop > self.steps:
                within = f"--profile {start}:{self.steps} or " if start < self.steps else ""
                raise ConfigError(
                    f"--profile {self.profile} traces steps {start}..{stop - 1}, past the run's "
                    f"last step {self.steps - 1}: use {within}--steps {stop}"
                )
        if self.hardware != "auto":
            hardware.get_hardware(self.hardware)
        if self.wandb is not None:
            if not self.wandb.strip():
                raise ConfigError("--wandb needs a project name: --wandb my-project")
            wandb_log.require()
        elif self.wandb_entity is not None:
            raise ConfigError("--wandb-entity names who logs to --wandb PROJECT; add --wandb")

    def faults(self) -> tuple[str, ...]:
        """Every injected fault, --fault-stall among them."""
        if self.fault_stall is None:
            return self.fault
        if len(self.fault_stall.split(":")) != 3:
            raise ConfigError(f"--fault-stall {self.fault_stall!r} is not STEP:PROCESS:SECONDS")
        return (*self.fault, f"stall:{self.fault_stall}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run's configuration: one config per component, recorded as the run's config.json."""

    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    step: StepConfig = StepConfig()
    loop: LoopConfig = LoopConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    sync: SyncConfig | None = None
    """with a `replica` mesh axis: how its groups meet (None: no groups)"""

    def validate(self) -> None:
        self.optim.validate()
        self.data.validate()
        self.step.validate()
        self.loop.validate()
        self.checkpoint.validate()
        self.eval.validate()


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one step lays out over a mesh: its axis sizes, the rule table that maps logical axes
    onto them, the step's settings, the remat policy and the batch's shape. It answers once
    what every part of the step asks of it: how many devices share the batch or the sequence,
    and the rows of a microbatch."""

    sizes: tuple[tuple[str, int], ...]
    """mesh axis sizes, outermost first (jaxdist.mesh.MESH_AXES)"""
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
        return self.mesh_shape.get("replica", 1)

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

    def batch_problem(self) -> str | None:
        """Why the batch cannot be split into its microbatches over the batch axes, or None."""
        if self.sync is not None and not self.in_group:
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

    def group(self) -> "Layout":
        """The layout one replica group steps under: its block of the batch, the groups'
        axis left to the caller (jaxdist.parallel.replica maps the step over it)."""
        return dataclasses.replace(self, batch_size=self.batch_size // self.replicas, in_group=True)
