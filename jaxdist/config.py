"""A run's configuration, as frozen values: the optimizer's, the data's, the loop's and
evaluation's, and the `RunConfig` that gathers them with the checkpoints'
(jaxdist.checkpoint.interval) and the step's and replica groups' (which live with the `Layout`
in jaxdist.layout). A run records all of it (config.json).

Plain values on purpose: a command line is parsed, checked and printed (`--help`) without
loading jax, optax or grain; what runs imports them when it runs.
"""

import dataclasses
from typing import Annotated, Literal

import tyro

from jaxdist import hardware
from jaxdist.checkpoint.interval import CheckpointConfig
from jaxdist.cluster import faults as fault_injection
from jaxdist.errors import ConfigError
from jaxdist.layout import StepConfig, SyncConfig, check_choice
from jaxdist.metrics import wandb_log

NonFinitePolicy = Literal["skip", "rollback", "stop"]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    # The aliases are the command line's short names (jaxdist.cli reads these dataclasses).
    learning_rate: Annotated[float, tyro.conf.arg(aliases=("--lr",))] = 3e-3
    """peak learning rate, reached after the warmup (AdamW's, also beside --optimizer muon)"""
    warmup_steps: int = 20
    """steps of linear warmup from zero to the peak learning rate"""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """the learning rate's shape after the warmup"""
    decay_steps: int = 0
    """decay length; 0: the whole run"""
    min_lr_ratio: float = 0.1
    """the learning rate decays to this share of its peak"""
    b1: float = 0.9
    """AdamW's first-moment decay"""
    b2: float = 0.95
    """AdamW's second-moment decay"""
    eps: float = 1e-8
    """Adam's epsilon (and Muon's, in its normalization before Newton-Schulz)"""
    weight_decay: float = 0.1
    """decoupled weight decay, on weight matrices only"""
    clip_norm: Annotated[float, tyro.conf.arg(aliases=("--clip",))] = 1.0
    """global gradient norm clipped to this; 0: no clipping"""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """muon: Muon on the weight matrices, AdamW on embeddings, the head, norms and biases"""
    muon_lr: float = 0.02
    """Muon's peak learning rate, on the same warmup and decay (--lr stays AdamW's)"""
    muon_beta: float = 0.95
    """Muon's (Nesterov) momentum decay"""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations that orthogonalize Muon's momentum"""

    def validate(self) -> None:
        if not self.learning_rate > 0:
            raise ConfigError(f"--lr {self.learning_rate} must be > 0")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ConfigError(
                f"--warmup-steps {self.warmup_steps} and --decay-steps {self.decay_steps} "
                "must be >= 0"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min-lr-ratio {self.min_lr_ratio} must lie in [0, 1]")
        for name, b in (("b1", self.b1), ("b2", self.b2)):
            if not 0 <= b < 1:
                raise ConfigError(f"--{name} {b} must lie in [0, 1) (Adam's moment decay)")
        if not self.eps > 0:
            raise ConfigError(f"--eps {self.eps} must be > 0 (it keeps Adam's division finite)")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay {self.weight_decay} must be >= 0")
        if self.clip_norm < 0:
            raise ConfigError(f"--clip {self.clip_norm} must be >= 0 (0: no clipping)")
        if not self.muon_lr > 0:
            raise ConfigError(f"--muon-lr {self.muon_lr} must be > 0")
        if not 0 <= self.muon_beta < 1:
            raise ConfigError(f"--muon-beta {self.muon_beta} must lie in [0, 1) (momentum decay)")
        if self.muon_ns_steps < 1:
            raise ConfigError(f"--muon-ns-steps {self.muon_ns_steps} must be >= 1")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str | None = None
    """a tokenized directory (jaxdist tokenize), a mixture NAME=DIR:WEIGHT,..., or a text or
    JSONL file or directory read as bytes; default: the embedded corpus (Python's stdlib)"""
    batch_size: int = 16
    seed: int = 0

    def validate(self) -> None:
        """Also TokenBatches' first step: batches built without the CLI refuse the same."""
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size {self.batch_size} must be at least 1")
        # grain's shuffle refuses a seed outside 32 bits, in a message that names no flag.
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"--seed {self.seed} must be >= 0 and below 2**32")


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
    """directory for config.json, metrics.jsonl, summary.json, checkpoints; pass the same one
    again to resume (default: a new runs/<time>)"""
    peak_tflops: float | None = None
    """peak TFLOP/s per device for MFU, where the device kind is not known (default: the device
    kind's, from jaxdist/hardware.toml)"""
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
    """the W&B team or user to log under (default: the API key's own)"""

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps {self.steps} must be at least 1")
        if self.log_every < 1:
            raise ConfigError(f"--log-every {self.log_every} must be at least 1")
        check_choice("--nonfinite", self.nonfinite, NonFinitePolicy)
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
            start, stop = self.profile_steps()
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

    def profile_steps(self) -> tuple[int, int] | None:
        """--profile START:STOP as the steps it traces, START to STOP - 1; None without it."""
        if not self.profile:
            return None
        a, sep, b = self.profile.partition(":")
        if not sep or not a.isdigit() or not b.isdigit() or int(b) <= int(a):
            raise ConfigError(
                f"--profile {self.profile!r} is not START:STOP with STOP > START, e.g. 5:8"
            )
        return int(a), int(b)

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
