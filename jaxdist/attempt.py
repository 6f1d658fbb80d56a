"""One attempt at a run (a process, from its start to its end): what the loop works with
besides the train state, and the work it does between steps.

`Run` is what the attempt is given, the same for every attempt of the run: the model, its
jitted step, the data, the run directory. `open_attempt` starts one: the run's record (checked
against its checkpoint before anything is written), the first state (`restore_or_init`: the
newest good checkpoint of either tier, or a new one), the logs (metrics.jsonl and its sinks:
TensorBoard, W&B), the step timer and the checkpoint tiers. `Attempt` places batches and
evaluates; `close_attempt` commits the last save and writes summary.json.
"""

import dataclasses
import functools
import json
import pathlib
import time

import jax
from jax.sharding import Mesh
from rich.console import Console

from jaxdist import hardware
from jaxdist.checkpoint.damage import set_aside_steps
from jaxdist.checkpoint.local import LocalDamaged, LocalTier
from jaxdist.checkpoint.resume import rerun_hint, write_record
from jaxdist.checkpoint.store import Restored, param_shapes
from jaxdist.checkpoint.tiers import Stores, Tiers, open_stores
from jaxdist.cluster.faults import Faults
from jaxdist.cluster.watchdog import Watchdog
from jaxdist.config import RunConfig
from jaxdist.data import TokenBatches
from jaxdist.data.mixture import Tally
from jaxdist.errors import TrainingStopped
from jaxdist.evaluation import coverage, evaluate
from jaxdist.layout import AxisRules, spec
from jaxdist.metrics import wandb_log
from jaxdist.metrics.compiles import Clock
from jaxdist.metrics.goodput import Ledger, read_report, totals
from jaxdist.metrics.outer import Rounds
from jaxdist.metrics.progress import console_for, step_of
from jaxdist.metrics.records import MetricsLog, print_summary, read_metrics
from jaxdist.metrics.steptimer import StepTimer, summarize
from jaxdist.metrics.tensorboard import TensorBoardLog
from jaxdist.model import ModelSpec
from jaxdist.profiling.capture import Capture
from jaxdist.step import JittedStep


class NoCheckpointRestores(TrainingStopped):
    """The run holds checkpoints, none of which restores, and --allow-fresh-start was not
    given; they all stay. The CLI prints the message as one line and exits 1."""


@dataclasses.dataclass(frozen=True)
class Run:
    """What an attempt is given, the same for every attempt of the run (jaxdist.train.fit
    builds it once everything is checked)."""

    model: ModelSpec
    mesh: Mesh
    rules: AxisRules
    config: RunConfig
    jitted: JittedStep
    batches: TokenBatches  # this process's rows of each batch
    held_out: TokenBatches | None  # the eval stream, if the run evaluates
    run_dir: pathlib.Path
    console: Console


@dataclasses.dataclass(frozen=True)
class Attempt:
    """What one attempt owns (this process, from its start to its end) besides the train
    state, and the work it does between steps."""

    run: Run
    start: int  # the first step this attempt runs
    t_start: float  # perf_counter at its start: summary.json's wall_s
    ledger: Ledger  # goodput: every second of this attempt, from its process's start
    log: MetricsLog | None  # process 0's
    capture: Capture
    watchdog: Watchdog
    timer: StepTimer
    faults: Faults
    tiers: Tiers
    mixture: Tally

    @functools.cached_property
    def eval_coverage(self) -> dict[str, int]:
        return coverage(self.run.held_out, self.run.config.eval.eval_batches)

    def place(self, s: int) -> jax.Array:
        # Stage 1: each process hands over only its own rows; JAX assembles the global batch.
        batches = self.run.batches
        with self.ledger.part("data"):
            return jax.make_array_from_process_local_data(
                self.run.jitted.batch_sharding, batches.batch(s), batches.global_shape
            )

    def evaluate(self, state, s: int) -> None:
        # The loop waits for it: its time is the run's, not the step's (excluded from it).
        # Step s itself must finish first: that wait is step time, as before a save.
        jax.block_until_ready(state)
        t0, compiles = time.perf_counter(), Clock()
        compiled0 = compiles.seconds()
        run = self.run
        # An evaluation is no step: the watchdog's slow-step alarm waits (a hang still ends it).
        with self.ledger.part("eval"), self.watchdog.between_steps():
            loss = evaluate(
                run.jitted,
                run.jitted.weights(state),
                run.held_out,
                range(run.config.eval.eval_batches),
            )
        seconds = time.perf_counter() - t0
        compiled = compiles.seconds() - compiled0  # the first evaluation compiles
        self.timer.exclude(seconds)
        tokens, distinct = self.eval_coverage["tokens"], self.eval_coverage["distinct_tokens"]
        if self.log:
            self.log.write(
                {
                    "step": s,
                    "eval_loss": loss,
                    "eval_tokens": tokens,
                    "eval_distinct_tokens": distinct,
                    "eval_s": seconds,
                }
            )
        repeat = f" (batches repeat: {distinct:,} distinct)" if distinct < tokens else ""
        took = f"{seconds:.1f} s" + (
            f", {compiled:.1f} s of it compiling" if compiled >= 0.05 else ""
        )
        run.console.print(
            f"{step_of(s, run.config.loop.steps)}  eval_loss {loss:.4f} over {tokens:,} "
            f"tokens{repeat} ({took})",
            highlight=False,
            soft_wrap=True,
        )


def _logs(run: Run, record: dict, ledger: Ledger, start: int) -> MetricsLog | None:
    """Process 0's metrics.jsonl and its sinks (TensorBoard, W&B); None on the others."""
    if jax.process_index() != 0:
        return None
    loop = run.config.loop
    sinks = [TensorBoardLog(run.run_dir / "tb", first_step=start)]
    if loop.wandb:
        sinks.append(
            wandb_log.WandbLog(run.run_dir, loop.wandb, loop.wandb_entity, record, run.console)
        )
    return MetricsLog(run.run_dir / "metrics.jsonl", *sinks, stamp=ledger.fields)


def data_record(batches) -> dict:
    """What the run's record says of its data stream (the checkpoint's must match it)."""
    return {
        "fingerprint": batches.fingerprint,
        "tokenizer": batches.tokenizer,
        "vocab_size": batches.vocab_size,
        "eos_id": batches.eos_id,
        "sources": batches.names,
    }


def open_attempt(run: Run, extra: dict | None = None, init_state=None) -> tuple[Attempt, object]:
    """An attempt's start: the run's record (checked against its checkpoint before anything is
    written; `extra` joins it), the first state (the newest good checkpoint's, or a new one:
    `init_state(jitted)`), the logs."""
    model, mesh, config, jitted, batches = run.model, run.mesh, run.config, run.jitted, run.batches
    loop, run_dir, console = config.loop, run.run_dir, run.console
    # Checked against the checkpoint's record before anything is written or compiled.
    record = write_record(
        run_dir, model, mesh, run.rules, config, data_record(batches), extra, console
    )
    faults = Faults(loop.faults(), run_dir, jax.process_index())
    stores = open_stores(config.checkpoint, run_dir, faults)
    shapes = param_shapes(jitted.abstract_state.params)
    t_start = time.perf_counter()
    ledger = Ledger()  # goodput: every second of this attempt, from its process's start
    # The earlier attempts' records, read once: what is recomputed, and their save costs.
    past = read_metrics(run_dir / "metrics.jsonl")
    try:
        state, start, restored = restore_or_init(
            stores, jitted, shapes, run_dir, past, console, init_state,
            config.checkpoint.allow_fresh_start,
        )  # fmt: skip
    except BaseException:
        # Orbax's threads (the temporary directories' cleanup) end before the process does,
        # or they complain at interpreter shutdown, after the one message that matters.
        stores.close()
        raise
    ledger.begin(start, past)
    log = _logs(run, record, ledger, start)
    hw = loop.hardware if loop.hardware != "auto" else hardware.preset_name(jax.devices()[0])
    capture = Capture(run_dir, loop, jitted, batches.global_shape, mesh, hw, console, log)
    watchdog = Watchdog(
        console_for(stderr=True), loop.slow_step_factor, hang_timeout=loop.hang_timeout,
        on_hang=log.close if log else None,
    )  # fmt: skip
    rounds = Rounds(jitted, past, start) if jitted.layout.grouped else None
    timer = StepTimer(
        model, config.data, loop, start, capture, watchdog, log, console, ledger, rounds
    )
    ckpt_meta = {
        "config": record,
        "param_shapes": shapes,
        "mesh": dict(mesh.shape),
        "run": str(run_dir.resolve()),  # a local tier is used only by the run that wrote it
    }
    tiers = Tiers(stores, config.checkpoint, ckpt_meta, timer, ledger, log, console)
    if restored is not None:
        tiers.resume(restored.step, past)
    tiers.prepare(jitted.abstract_state)
    attempt = Attempt(
        run=run, start=start, t_start=t_start, ledger=ledger, log=log, capture=capture,
        watchdog=watchdog, timer=timer, faults=faults, tiers=tiers,
        mixture=Tally(batches.draw, batches.names, start),
    )  # fmt: skip
    console.print(
        f"[bold]jaxdist[/] {model.name} ({jitted.num_params / 1e6:.2f}M params) on mesh "
        f"{jitted.layout.describe()} x {jax.devices()[0].platform}, steps {start}.."
        f"{loop.steps - 1}, "
        f"batch {config.data.batch_size} x {model.seq_len}; run dir {run_dir}"
    )
    return attempt, state


def restore_or_init(
    stores: Stores,
    jitted: JittedStep,
    shapes,
    run_dir,
    past: list[dict],
    console,
    init_state=None,
    allow_fresh_start: bool = False,
):
    """Stage 5, recover: the newest checkpoint of either tier that reads and verifies (the
    local tier's only where it is newer), resharded onto this mesh, or a fresh state
    (`init_state(compiled)` if given, e.g. pretrained weights, else the model's init).
    `past`: the run's metrics records so far. Returns (state, first step to run, the restored
    checkpoint)."""
    checkpointer = stores.checkpointer
    before = checkpointer.steps()
    newest = before[-1] if before else -1
    restored = _restore_local(stores.local, newest, jitted, run_dir, console)
    restored = restored or checkpointer.restore_latest(jitted.abstract_state, shapes)
    if restored is None:
        aside = set_aside_steps(checkpointer.directory)
        if (before or aside) and not allow_fresh_start:
            raise NoCheckpointRestores(
                f"{run_dir} holds checkpoints but none restores (set aside as damaged: "
                f"{', '.join(aside) or 'none'}, in {checkpointer.directory}); starting again "
                "at step 0 would leave their work behind. Look at them (jaxdist checkpoints "
                f"{run_dir}), or pass --allow-fresh-start to start over beside them"
            )
        return (init_state or (lambda c: c.init_fn()))(jitted), 0, None
    start = int(restored.state.step)
    logged = [r["step"] for r in past if "loss" in r]
    redo = (
        f"; steps {start}..{max(logged)} are recomputed" if logged and max(logged) >= start else ""
    )
    tier = " (local tier)" if restored.meta.get("tier") == "local" else ""
    console.print(
        f"resuming from checkpoint step {restored.step}{tier} (written on mesh "
        f"{_mesh_spec(restored.meta.get('mesh'))}) at step {start}{redo}",
        soft_wrap=True,
    )
    return restored.state, start, restored


def _mesh_spec(mesh) -> str:
    """A checkpoint's recorded mesh as --mesh takes it (as recorded, where it is no dict)."""
    return spec(mesh) if isinstance(mesh, dict) else str(mesh)


def _restore_local(
    local: LocalTier | None, persistent_newest: int, jitted: JittedStep, run_dir, console
) -> Restored | None:
    """The local tier's newest checkpoint every process holds, if newer than the persistent
    tier's; None (fall back to the persistent tier) if it is not, or does not read."""
    if local is None:
        return None
    run = str(pathlib.Path(run_dir).resolve())
    step = local.newest_common(jitted.abstract_state, accept=lambda meta: meta.get("run") == run)
    if step is None or step <= persistent_newest:
        return None
    try:
        state = local.restore(step, jitted.abstract_state)
    except LocalDamaged as e:
        console.print(
            f"local checkpoint {step} does not restore ({e}); falling back to the persistent tier",
            highlight=False,
            soft_wrap=True,
        )
        return None
    return Restored(state, step, {"tier": "local", "mesh": dict(jitted.batch_sharding.mesh.shape)})


def close_attempt(a: Attempt, preempted: tuple[int, str] | None) -> dict:
    """The attempt's end: the last save committed, the logs closed, summary.json."""
    run = a.run
    a.capture.close()
    a.tiers.close(finished=preempted is None)  # waits for the last save to commit
    if a.log:
        # The attempt's final accounting; a signal's stop is not the run's end (goodput says so).
        a.log.write({"event": "end", **({"stopped": preempted[1]} if preempted else {})})
        a.log.close()
    if preempted:
        run.console.print(
            f"{preempted[1]} received: saved step {preempted[0]} and committed it; to resume, "
            f"{rerun_hint(run.run_dir)}",
            markup=False,
            soft_wrap=True,
            highlight=False,
        )
    wall = time.perf_counter() - a.t_start
    summary = summarize(
        run.model, run.jitted, run.mesh, run.config.loop, a.start, preempted, a.timer,
        a.tiers.saves, wall,
    )  # fmt: skip
    summary["run_dir"] = str(run.run_dir)
    evals = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "eval_loss" in r]
    if evals:  # the newest evaluation, of this attempt or an earlier one
        summary["eval_loss"] = {"step": evals[-1]["step"], "loss": evals[-1]["eval_loss"]}
    if jax.process_index() == 0:
        summary["goodput"] = totals(read_report(run.run_dir))  # over every attempt of the run
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        # The result on stdout (`jaxdist train > log` keeps it); progress stays on stderr.
        out = console_for(stderr=False, quiet=run.console.quiet)
        print_summary(out, summary)
    return summary
