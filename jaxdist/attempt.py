"""One attempt at a run (a process, from its start to its end): what the loop works with
besides the train state, and the work it does between steps.

`open_attempt` starts it: the run's record (checked against its checkpoint before anything is
written), the first state (the newest good checkpoint's, or a new one), the logs (metrics.jsonl
and its sinks: TensorBoard, W&B), the step timer. `Attempt` places batches, saves, evaluates
and counts a mixture's rows; `close_attempt` commits the last save and writes summary.json.
"""

import dataclasses
import functools
import hashlib
import json
import pathlib
import time

import jax
import numpy as np
from jax.sharding import Mesh
from rich.console import Console

from jaxdist import hardware
from jaxdist.checkpoint.interval import Interval
from jaxdist.checkpoint.local import LocalTier
from jaxdist.checkpoint.resume import rerun_hint, restore_or_init, write_record
from jaxdist.checkpoint.store import Checkpointer, param_shapes
from jaxdist.cluster.faults import Faults
from jaxdist.cluster.watchdog import Watchdog
from jaxdist.config import RunConfig
from jaxdist.data import TokenBatches
from jaxdist.evaluation import coverage, evaluate
from jaxdist.metrics import wandb_log
from jaxdist.metrics.goodput import Ledger, read_report, totals
from jaxdist.metrics.records import MetricsLog, print_summary, read_metrics
from jaxdist.metrics.steptimer import StepTimer, summarize
from jaxdist.metrics.tensorboard import TensorBoardLog
from jaxdist.model import ModelSpec
from jaxdist.profiling.capture import Capture
from jaxdist.step import JittedStep


@dataclasses.dataclass
class Attempt:
    """One attempt at a run (this process, from its start to its end): what the loop works with
    besides the train state, and the work it does between steps."""

    model: ModelSpec
    mesh: Mesh
    config: RunConfig
    jitted: JittedStep
    batches: TokenBatches
    held_out: TokenBatches | None
    run_dir: pathlib.Path
    console: Console
    checkpointer: Checkpointer
    shapes: dict
    ckpt_meta: dict
    t_start: float
    ledger: Ledger
    start: int
    log: MetricsLog | None
    interval: Interval
    capture: Capture
    watchdog: Watchdog
    timer: StepTimer
    mixture: np.ndarray  # rows drawn per source, from step 0
    faults: Faults
    local: LocalTier | None  # the node-local tier, if --local-checkpoint-dir
    local_interval: Interval | None
    saves: list[float] = dataclasses.field(default_factory=list)

    def newest_checkpoint(self) -> str:
        """The newest committed checkpoint, in words; from a directory listing alone, so that
        a thread may ask while the loop is stuck (Orbax's own lists may be locked)."""
        steps = sorted(
            int(p.name) for p in self.checkpointer.directory.glob("*") if p.name.isdigit()
        )
        return f"checkpoint {steps[-1]}, the newest committed," if steps else "no checkpoint"

    @functools.cached_property
    def eval_coverage(self) -> dict[str, int]:
        return coverage(self.held_out, self.config.eval.eval_batches)

    def place(self, s: int) -> jax.Array:
        # Stage 1: each process hands over only its own rows; JAX assembles the global batch.
        with self.ledger.part("data"):
            return jax.make_array_from_process_local_data(
                self.jitted.batch_sharding, self.batches.batch(s), self.batches.global_shape
            )

    def count_mixture(self, s: int) -> None:
        """Step s's rows per source, into the proportions logged with each record."""
        if len(self.mixture) < 2:
            return
        self.mixture += np.bincount(self.batches.draw.sources(s), minlength=len(self.mixture))
        shares = (self.mixture / self.mixture.sum()).tolist()
        self.timer.extra = {"mixture": dict(zip(self.batches.names, shares, strict=True))}

    def evaluate(self, state, s: int) -> None:
        # The loop waits for it: its time is the run's, not the step's (excluded from it).
        # Step s itself must finish first: that wait is step time, as before a save.
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        n = self.config.eval.eval_batches
        with self.ledger.part("eval"):
            loss = evaluate(self.jitted, state.params, self.held_out, range(n))
        seconds = time.perf_counter() - t0
        self.timer.exclude(seconds)
        self.watchdog.alive()
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
        self.console.print(
            f"step {s:5d}  eval_loss {loss:.4f} over {tokens:,} tokens{repeat} ({seconds:.1f} s)",
            highlight=False,
            soft_wrap=True,
        )

    def save(self, state, s: int) -> None:
        # Stage 5. Wait for step s itself first: that wait is step time; the rest is the save's.
        jax.block_until_ready(state)
        with self.ledger.part("checkpoint"):
            blocked = self.checkpointer.save(s, state, self.ckpt_meta)
        self.saves.append(blocked)
        self._saved("persistent", self.interval, s, blocked)

    def save_local(self, state, s: int) -> None:
        """A save to the node-local tier only: this process's own shards, on its own disk."""
        jax.block_until_ready(state)
        with self.ledger.part("checkpoint"):
            blocked = self.local.save(s, state, self.ckpt_meta)
        self._saved("local", self.local_interval, s, blocked)

    def _saved(self, tier: str, interval: Interval, s: int, blocked: float) -> None:
        self.timer.exclude(blocked)  # the device idles while the loop is blocked: reported apart
        self.watchdog.alive()
        if self.log:  # per save, so a run that is killed still leaves its save costs behind
            self.log.write({"event": "save", "tier": tier, "step": s, "blocked_s": blocked})
        self._log_interval(tier, s, interval.observe(s, blocked, self.timer.p50()))

    def due(self, tier: str, s: int) -> bool:
        """Whether tier's save is due after step s; an auto interval not yet chosen (the first
        save came before any step time) is chosen as soon as the step time is known."""
        interval = self.interval if tier == "persistent" else self.local_interval
        if interval.steps is None and interval.last_saved is not None:
            self._log_interval(tier, s, interval.choose(self.timer.p50()))
        return interval.due(s)

    def _log_interval(self, tier: str, s: int, chosen: dict | None) -> None:
        if chosen and self.log:
            self.log.write({"event": "checkpoint_interval", "tier": tier, "step": s, **chosen})
            self.console.print(
                f"{tier} checkpoint interval (Young-Daly): every {chosen['interval_steps']} "
                f"steps = {chosen['interval_s']:.1f} s, from save cost "
                f"{chosen['save_blocked_s'] * 1e3:.0f} ms and MTBF "
                f"{chosen['mtbf_system_s'] / 3600:.1f} h",
                highlight=False,
            )


def _tiers(config: RunConfig, run_dir: pathlib.Path, faults: Faults):
    """The persistent checkpointer, the local tier (or None) and their intervals."""
    ck = config.checkpoint
    checkpointer = Checkpointer(run_dir / "checkpoints", ck.keep, rerun_hint(run_dir), faults)
    interval = Interval(ck, jax.device_count())
    local = local_interval = None
    if ck.local_dir is not None:
        # A folder per run: runs sharing a node's disk never prune each other's checkpoints.
        run = str(run_dir.resolve())
        key = f"{run_dir.resolve().name}-{hashlib.sha1(run.encode()).hexdigest()[:8]}"
        local = LocalTier(pathlib.Path(ck.local_dir) / key, keep=2)
        local_interval = Interval(ck, jax.device_count(), tier="local")
    return checkpointer, interval, local, local_interval


def open_attempt(
    model, mesh, rules, config: RunConfig, prepared, run_dir, console, extra, init_state
) -> tuple[Attempt, object]:
    """An attempt's start: the run's record (checked against its checkpoint before anything is
    written), the first state (the newest good checkpoint's, or a new one), the logs."""
    jitted, batches, held_out = prepared
    loop, data = config.loop, config.data
    data_record = {
        "fingerprint": batches.fingerprint,
        "tokenizer": batches.tokenizer,
        "vocab_size": batches.vocab_size,
        "eos_id": batches.eos_id,
        "sources": batches.names,
    }
    # Checked against the checkpoint's record before anything is written or compiled.
    record = write_record(run_dir, model, mesh, rules, config, data_record, extra, console)
    faults = Faults(loop.faults(), run_dir, jax.process_index())
    checkpointer, interval, local, local_interval = _tiers(config, run_dir, faults)
    shapes = param_shapes(jitted.abstract_state.params)
    ckpt_meta = {
        "config": record,
        "param_shapes": shapes,
        "mesh": dict(mesh.shape),
        "run": str(run_dir.resolve()),  # a local tier is used only by the run that wrote it
    }
    t_start = time.perf_counter()
    ledger = Ledger()  # goodput: every second of this attempt, from its process's start
    # The earlier attempts' records, read once: what is recomputed, and their save costs.
    past = read_metrics(run_dir / "metrics.jsonl")
    try:
        state, start, restored = restore_or_init(
            checkpointer, jitted, shapes, run_dir, past, console, init_state, local,
            config.checkpoint.allow_fresh_start,
        )  # fmt: skip
    except BaseException:
        # Orbax's threads (the temporary directories' cleanup) end before the process does,
        # or they complain at interpreter shutdown, after the one message that matters.
        checkpointer.close()
        if local is not None:
            local.close()
        raise
    ledger.begin(start, past)
    log = None
    if jax.process_index() == 0:
        sinks = [TensorBoardLog(run_dir / "tb", first_step=start)]
        if loop.wandb:
            sinks.append(
                wandb_log.WandbLog(run_dir, loop.wandb, loop.wandb_entity, record, console)
            )
        log = MetricsLog(run_dir / "metrics.jsonl", *sinks, stamp=ledger.fields)
    if restored is not None:
        # A resumed attempt does not save at once to learn the save cost: the earlier
        # attempts measured it, and the interval is chosen from theirs once steps are timed.
        interval.resume(restored.step, past, "persistent")
        if local_interval is not None:
            local_interval.resume(restored.step, past, "local")
    hw = loop.hardware if loop.hardware != "auto" else hardware.preset_name(jax.devices()[0])
    capture = Capture(run_dir, loop, jitted, batches.global_shape, mesh, hw, console, log)
    watchdog = Watchdog(
        Console(stderr=True), loop.slow_step_factor, hang_timeout=loop.hang_timeout,
        on_hang=log.close if log else None,
    )  # fmt: skip
    timer = StepTimer(model, data, loop, start, capture, watchdog, log, console, ledger)
    mixture = np.zeros(len(batches.sources), np.int64)
    for s in range(start) if len(mixture) > 1 else ():
        mixture += np.bincount(batches.draw.sources(s), minlength=len(mixture))
    attempt = Attempt(
        model=model, mesh=mesh, config=config, jitted=jitted, batches=batches,
        held_out=held_out, run_dir=run_dir, console=console, checkpointer=checkpointer,
        shapes=shapes, ckpt_meta=ckpt_meta, t_start=t_start, ledger=ledger, start=start,
        log=log, interval=interval, capture=capture, watchdog=watchdog, timer=timer,
        mixture=mixture, faults=faults, local=local, local_interval=local_interval,
    )  # fmt: skip
    console.print(
        f"[bold]jaxdist[/] {model.name} ({jitted.num_params / 1e6:.2f}M params) on mesh "
        f"{dict(mesh.shape)} x {jax.devices()[0].platform}, steps {start}..{loop.steps - 1}, "
        f"batch {data.batch_size} x {model.seq_len}; run dir {run_dir}"
    )
    return attempt, state


def close_attempt(a: Attempt, preempted: tuple[int, str] | None) -> dict:
    """The attempt's end: the last save committed, the logs closed, summary.json."""
    a.capture.close()
    with a.ledger.part("checkpoint"):
        a.checkpointer.close()  # waits for the last save to commit
        if a.local is not None:
            a.local.close()
    if a.log:
        a.log.write({"event": "end"})  # the attempt's final accounting
        a.log.close()
    if preempted:
        a.console.print(
            f"{preempted[1]} received: saved step {preempted[0]} and committed it; to resume, "
            f"{rerun_hint(a.run_dir)}",
            markup=False,
            soft_wrap=True,
            highlight=False,
        )
    wall = time.perf_counter() - a.t_start
    loop = a.config.loop
    summary = summarize(a.model, a.jitted, a.mesh, loop, a.start, preempted, a.timer, a.saves, wall)
    summary["run_dir"] = str(a.run_dir)
    if jax.process_index() == 0:
        summary["goodput"] = totals(read_report(a.run_dir))  # over every attempt of the run
        (a.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print_summary(a.console, summary)
    return summary
