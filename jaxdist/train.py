"""The training loop: plain code, top to bottom, one jitted step.

Stages of a step as they appear in `run`: (1) distribute work: the mesh layout, and each batch
placed by the rules (`place`); (2) compute and (4) synchronize: the jitted `train_step`;
(3) move tensors: the collectives XLA compiled into it; (5) checkpoint and recover: async
saves on an interval, resume from the newest good checkpoint, preemption and non-finite steps.
"""

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np
from jax.sharding import Mesh
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from jaxdist import hardware
from jaxdist.checkpoint.interval import CheckpointConfig, Interval
from jaxdist.checkpoint.lock import RunLock
from jaxdist.checkpoint.recovery import (
    NonFinitePolicy,
    PreemptionSignal,
    apply_nonfinite_policy,
)
from jaxdist.checkpoint.resume import restore_or_init, write_record
from jaxdist.checkpoint.store import Checkpointer, param_shapes
from jaxdist.cluster.join import process_rows
from jaxdist.cluster.watchdog import Watchdog
from jaxdist.data import DataConfig, TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.evaluation import EvalConfig, eval_batches, evaluate
from jaxdist.metrics.goodput import Ledger, read_report, totals
from jaxdist.metrics.records import MetricsLog, print_summary
from jaxdist.metrics.steptimer import StepTimer, summarize
from jaxdist.metrics.tensorboard import TensorBoardLog
from jaxdist.model import ModelSpec
from jaxdist.optim import OptimConfig, make_optimizer
from jaxdist.profiling.capture import Capture, parse_range
from jaxdist.rules import AxisRules
from jaxdist.step import JittedStep, StepConfig, Vocab, build


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    steps: int = 300
    log_every: int = 10
    run_dir: str | None = None
    """directory for config.json, metrics.jsonl, summary.json, checkpoints (default
    runs/<time>)"""
    peak_tflops: float | None = None
    """peak TFLOP/s per device for MFU, where the device kind is not known"""
    seed: int = 0
    nonfinite: NonFinitePolicy = "skip"
    """on a NaN/Inf loss or gradient: skip the update, roll back to the last checkpoint and
    skip past the batch, or stop"""
    profile: str | None = None
    """START:STOP: trace these steps and write the step-time breakdown to the run dir"""
    watch_comm: float | None = None
    """warn when exposed communication or sync passes this fraction of a step (profiles a
    few steps every --watch-every steps)"""
    watch_every: int = 100
    hardware: str = "auto"
    """cost-model preset for profile reports (jaxdist.hardware); auto: the devices' own"""
    slow_step_factor: float = 10.0
    """report a step slower than this many times the p50 step, naming lagging processes"""
    fault_stall: str | None = None
    """fault injection, for testing the watchdog: STEP:PROCESS:SECONDS to stall"""

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
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"--peak-tflops {self.peak_tflops} must be > 0")
        if self.profile:
            parse_range(self.profile)
        self.stall()
        if self.hardware != "auto":
            hardware.get_hardware(self.hardware)

    def stall(self) -> tuple[int, int, float] | None:
        if self.fault_stall is None:
            return None
        try:
            step, process, seconds = self.fault_stall.split(":")
            return int(step), int(process), float(seconds)
        except ValueError:
            raise ConfigError(
                f"--fault-stall {self.fault_stall!r} is not STEP:PROCESS:SECONDS"
            ) from None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run's configuration: one config per component, recorded as the run's config.json."""

    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    step: StepConfig = StepConfig()
    loop: LoopConfig = LoopConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()

    def validate(self) -> None:
        self.optim.validate()
        self.data.validate()
        self.step.validate()
        self.loop.validate()
        self.checkpoint.validate()
        self.eval.validate()


def prepare(
    model: ModelSpec, mesh: Mesh, rules: AxisRules, config: RunConfig
) -> tuple[JittedStep, TokenBatches]:
    """Everything that can fail on bad input, done before anything is compiled: the data
    (opened, checksummed, its vocabulary checked against the model's), then the step."""
    config.validate()
    data, seed = config.data, config.loop.seed
    batches = TokenBatches(data, model.seq_len, model.vocab_size)
    tx, lr = make_optimizer(config.optim, config.loop.steps)
    vocab = Vocab(batches.vocab_size, batches.eos_id)
    jitted = build(model.init, tx, lr, rules, mesh, config.step, seed, data.batch_size, vocab)
    rows = process_rows(jitted.batch_sharding, (data.batch_size, model.seq_len + 1))
    return jitted, batches.for_rows(rows)


def fit(
    model: ModelSpec,
    mesh: Mesh,
    rules: AxisRules,
    config: RunConfig,
    console: Console | None = None,
    record: dict | None = None,
    init_state=None,
) -> dict:
    """Trains to config.loop.steps, resuming from the run directory if it holds a checkpoint;
    returns the summary (also written to summary.json). `record` joins config.json (the
    command line's config tree, under `cli`). `init_state(compiled) -> TrainState`: the first
    state of a new run (e.g. pretrained weights) instead of the model's random init."""
    # Bad input ends here, before the run directory is created or anything compiles.
    jitted, batches = prepare(model, mesh, rules, config)
    data = config.data
    explicit_eval = bool(config.eval.eval_every) or config.eval.eval_data is not None
    held_out = eval_batches(
        config.eval, data, model.seq_len, model.vocab_size, jitted.batch_sharding, explicit_eval
    )
    if held_out is not None and held_out.vocab_size > batches.vocab_size:
        raise ConfigError(
            f"eval data {config.eval.eval_data} has a vocabulary of {held_out.vocab_size}, the "
            f"training data {batches.vocab_size}; evaluate on data of the same tokenizer"
        )
    prepared = jitted, batches, held_out
    run_dir = pathlib.Path(config.loop.run_dir or time.strftime("runs/%Y%m%d-%H%M%S"))
    # One trainer per run directory: a second is refused here, before anything compiles.
    with RunLock(run_dir, jax.process_index()):
        return _run(model, mesh, rules, config, prepared, run_dir, console, record, init_state)


def _run(
    model, mesh, rules, config: RunConfig, prepared, run_dir, console, extra, init_state=None
) -> dict:
    console = console or Console(stderr=True)
    if jax.process_index() != 0:
        console = Console(stderr=True, quiet=True)  # process 0 speaks for the run
    jitted, batches, held_out = prepared
    loop, data, ckpt = config.loop, config.data, config.checkpoint
    data_record = {
        "fingerprint": batches.fingerprint,
        "tokenizer": batches.tokenizer,
        "vocab_size": batches.vocab_size,
        "eos_id": batches.eos_id,
        "sources": batches.names,
    }
    # Checked against the checkpoint's record before anything is written or compiled.
    record = write_record(run_dir, model, mesh, rules, config, data_record, extra, console)
    checkpointer = Checkpointer(run_dir / "checkpoints", ckpt.keep)
    shapes = param_shapes(jitted.abstract_state.params)
    ckpt_meta = {"config": record, "param_shapes": shapes, "mesh": dict(mesh.shape)}
    t_start = time.perf_counter()
    ledger = Ledger()  # goodput: every second of this attempt, from its process's start
    state, start, restored = restore_or_init(
        checkpointer, jitted, shapes, run_dir, console, init_state
    )
    ledger.begin(start, run_dir / "metrics.jsonl")
    log = None
    if jax.process_index() == 0:
        tb = TensorBoardLog(run_dir / "tb", first_step=start)
        log = MetricsLog(run_dir / "metrics.jsonl", tb, stamp=ledger.fields)
    interval = Interval(ckpt, jax.device_count())
    if restored is not None:
        interval.last_saved = restored.step
    global_shape = (data.batch_size, model.seq_len + 1)
    hw = loop.hardware if loop.hardware != "auto" else hardware.preset_name(jax.devices()[0])
    capture = Capture(run_dir, loop, jitted, global_shape, mesh, hw, console, log)
    watchdog = Watchdog(Console(stderr=True), loop.slow_step_factor)
    timer = StepTimer(model, data, loop, start, capture, watchdog, log, console, ledger)
    saves: list[float] = []
    mixture = np.zeros(len(batches.sources), np.int64)  # rows drawn per source, from step 0
    for s in range(start) if len(mixture) > 1 else ():
        mixture += np.bincount(batches.draw.sources(s), minlength=len(mixture))
    eval_every = config.eval.eval_every or 0

    def run_eval(s: int) -> None:
        # The loop waits for it: its time is the run's, not the step's (excluded from it).
        # Step s itself must finish first: that wait is step time, as before a save.
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        n = config.eval.eval_batches
        with ledger.part("eval"):
            loss = evaluate(jitted, state.params, held_out, range(n))
        seconds = time.perf_counter() - t0
        timer.exclude(seconds)
        tokens = n * data.batch_size * model.seq_len
        if log:
            log.write({"step": s, "eval_loss": loss, "eval_tokens": tokens, "eval_s": seconds})
        console.print(
            f"step {s:5d}  eval_loss {loss:.4f} over {tokens:,} tokens ({seconds:.1f} s)",
            highlight=False,
        )

    def place(s: int) -> jax.Array:
        # Stage 1: each process hands over only its own rows; JAX assembles the global batch.
        with ledger.part("data"):
            return jax.make_array_from_process_local_data(
                jitted.batch_sharding, batches.batch(s), global_shape
            )

    def save(s: int) -> None:
        # Stage 5. Wait for step s itself first: that wait is step time; the rest is the save's.
        jax.block_until_ready(state)
        with ledger.part("checkpoint"):
            blocked = checkpointer.save(s, state, ckpt_meta)
        timer.exclude(blocked)  # the device idles while the loop is blocked: reported apart
        saves.append(blocked)
        if log:  # per save, so a run that is killed still leaves its save costs behind
            log.write({"event": "save", "step": s, "blocked_s": blocked})
        chosen = interval.observe(s, blocked, timer.p50())
        if chosen and log:
            log.write({"event": "checkpoint_interval", "step": s, **chosen})
            console.print(
                f"checkpoint interval (Young-Daly): every {chosen['interval_steps']} "
                f"steps = {chosen['interval_s']:.1f} s, from save cost "
                f"{chosen['save_blocked_s'] * 1e3:.0f} ms and system MTBF "
                f"{chosen['mtbf_system_s'] / 3600:.1f} h",
                highlight=False,
            )

    console.print(
        f"[bold]jaxdist[/] {model.name} ({jitted.num_params / 1e6:.2f}M params) on mesh "
        f"{dict(mesh.shape)} x {jax.devices()[0].platform}, steps {start}..{loop.steps - 1}, "
        f"batch {data.batch_size} x {model.seq_len}; run dir {run_dir}"
    )
    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    preempted = None
    pending: tuple[int, dict] | None = None
    stall = loop.stall()
    ledger.mark("startup")
    with progress, PreemptionSignal() as signal_flag, watchdog:
        task = progress.add_task("compiling", total=loop.steps, completed=start)
        s = start
        while s < loop.steps:
            if stall and stall[:2] == (s, jax.process_index()):
                time.sleep(stall[2])
            # Stages 2-4: forward/backward, the collectives, the update; dispatched, not awaited.
            with capture.step(s, state):
                state, metrics = jitted.step_fn(state, place(s))
            capture.after(s, metrics)
            # Step s-1's scalars: s is already queued, so the device never idles for logging.
            if pending is not None:
                rec = timer.finish(*pending)
                progress.update(task, completed=s, description=f"loss {rec['loss']:.3f}")
                if not rec["finite"]:
                    rolled = apply_nonfinite_policy(
                        loop.nonfinite, rec["step"], checkpointer, jitted, shapes, console
                    )
                    if rolled is not None:  # drop the step in flight; resume past the bad batch
                        state, s, pending = rolled, rec["step"] + 1, None
                        continue
            pending = (s, metrics)
            if len(mixture) > 1:
                mixture += np.bincount(batches.draw.sources(s), minlength=len(mixture))
                timer.extra = {
                    "mixture": dict(
                        zip(batches.names, (mixture / mixture.sum()).tolist(), strict=True)
                    )
                }
            if held_out is not None and eval_every and (s + 1) % eval_every == 0:
                run_eval(s)
            stop = signal_flag.stop_at(s)
            if stop or interval.due(s) or s == loop.steps - 1:
                save(s)
            if stop:
                preempted = (s, signal_flag.received)
                break
            s += 1
        if pending is not None:
            rec = timer.finish(*pending)
            if not rec["finite"]:
                policy = "skip" if loop.nonfinite == "rollback" else loop.nonfinite
                apply_nonfinite_policy(policy, rec["step"], checkpointer, jitted, shapes, console)
        last_eval = eval_every and loop.steps % eval_every == 0
        if held_out is not None and not preempted and not last_eval and start < loop.steps:
            run_eval(loop.steps - 1)
    capture.close()
    with ledger.part("checkpoint"):
        checkpointer.close()  # waits for the last save to commit
    if log:
        log.write({"event": "end"})  # the attempt's final accounting
        log.close()
    if preempted:
        console.print(
            f"{preempted[1]} received: saved step {preempted[0]} and committed it; "
            "rerun the same command to resume"
        )
    wall = time.perf_counter() - t_start
    summary = summarize(model, jitted, mesh, loop, start, preempted, timer, saves, wall)
    summary["run_dir"] = str(run_dir)
    if jax.process_index() == 0:
        summary["goodput"] = totals(read_report(run_dir))  # over every attempt of the run
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print_summary(console, summary)
    return summary
