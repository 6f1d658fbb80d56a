"""The training loop: plain code, top to bottom, one jitted step.

Stages of a step as they appear below: (1) distribute work: the mesh layout, and each batch
placed by the rules (`place`); (2) compute and (4) synchronize: the jitted `train_step`;
(3) move tensors: the collectives XLA compiled into it; (5) checkpoint and recover: async
saves on an interval, resume from the newest good checkpoint, preemption and non-finite steps.
"""

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from jaxdist import hardware
from jaxdist.checkpoint.interval import CheckpointConfig, Interval
from jaxdist.checkpoint.recovery import NonFinitePolicy, PreemptionSignal, TrainingStopped
from jaxdist.checkpoint.store import Checkpointer, param_shapes
from jaxdist.cluster.join import local_value, process_rows
from jaxdist.cluster.watchdog import Watchdog
from jaxdist.data import DataConfig, TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.metrics import MetricsLog, distribution, print_summary, read_metrics, throughput
from jaxdist.optim import OptimConfig, make_optimizer
from jaxdist.planning import hlo
from jaxdist.planning.memory import xla_peak
from jaxdist.profiling.capture import Capture
from jaxdist.rules import AxisRules
from jaxdist.step import Compiled, StepConfig, build


class ModelSpec(NamedTuple):
    """What the loop needs to know of a model, supplied by the caller (CLI or experiment)."""

    name: str
    init: Callable[[nnx.Rngs], nnx.Module]
    seq_len: int
    vocab_size: int
    flops_per_token: float
    config: Any  # a dataclass, recorded in the run directory


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    steps: int = 300
    log_every: int = 10
    run_dir: str | None = None
    peak_tflops: float | None = None  # per device; None: look it up from the device kind
    seed: int = 0
    nonfinite: NonFinitePolicy = "skip"
    profile: tuple[int, int] | None = None  # trace steps [a, b) and attribute them
    watch_comm: float | None = None  # trace a few steps every watch_every; warn over this
    watch_every: int = 100
    hardware: str = "cpu"  # cost-model preset for the profile report
    slow_step_factor: float = 10.0  # report a step slower than this x p50
    # Fault injection, for testing the watchdog: (step, process, seconds) to stall.
    fault_stall: tuple[int, int, float] | None = None


def _record(obj) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def prepare(
    model: ModelSpec,
    mesh: Mesh,
    rules: AxisRules,
    optim: OptimConfig,
    data: DataConfig,
    step: StepConfig,
    loop: LoopConfig,
) -> tuple[Compiled, TokenBatches]:
    """Everything that can fail on bad input, done before anything is compiled."""
    if loop.steps < 1:
        raise ConfigError(f"--steps {loop.steps} must be at least 1")
    if loop.log_every < 1:
        raise ConfigError(f"--log-every {loop.log_every} must be at least 1")
    if loop.nonfinite not in ("skip", "rollback", "stop"):
        raise ConfigError(f"--nonfinite {loop.nonfinite!r}: use skip, rollback or stop")
    tx, lr = make_optimizer(optim, loop.steps)
    compiled = build(model.init, tx, lr, rules, mesh, step, loop.seed, data.batch_size)
    rows = process_rows(compiled.batch_sharding, (data.batch_size, model.seq_len + 1))
    batches = TokenBatches(data, model.seq_len, model.vocab_size, rows)
    return compiled, batches


def run(
    model: ModelSpec,
    mesh: Mesh,
    rules: AxisRules,
    optim: OptimConfig,
    data: DataConfig,
    step: StepConfig,
    loop: LoopConfig,
    ckpt: CheckpointConfig | None = None,
    console: Console | None = None,
) -> dict:
    """Trains to loop.steps, resuming from run_dir if it holds a checkpoint; returns the summary
    (also written to summary.json)."""
    console = console or Console(stderr=True)
    if jax.process_index() != 0:
        console = Console(stderr=True, quiet=True)  # process 0 speaks for the run
    ckpt = ckpt or CheckpointConfig()
    ckpt.validate()
    compiled, batches = prepare(model, mesh, rules, optim, data, step, loop)
    run_dir = pathlib.Path(loop.run_dir or time.strftime("runs/%Y%m%d-%H%M%S"))
    config_record = {
        "model": {"name": model.name, **_record(model.config)},
        "mesh": dict(mesh.shape),
        "rules": [list(r) for r in rules.rows],
        "optim": _record(optim),
        "data": _record(data),
        "step": _record(step),
        "loop": _record(loop),
        "checkpoint": _record(ckpt),
        "devices": {
            "count": jax.device_count(),
            "kind": jax.devices()[0].device_kind,
            "processes": jax.process_count(),
        },
        "versions": {"jax": jax.__version__},
    }
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            (run_dir / "config.json").write_text(json.dumps(config_record, indent=2))
    except OSError as e:
        raise ConfigError(
            f"cannot write run directory {run_dir}: {e.strerror}; pass a writable --run-dir"
        ) from None
    checkpointer = Checkpointer(run_dir / "checkpoints", ckpt.keep)
    shapes = param_shapes(compiled.abstract_state.params)
    ckpt_meta = {"config": config_record, "param_shapes": shapes, "mesh": dict(mesh.shape)}

    # Stage 5, recover: the newest checkpoint that reads and verifies, resharded onto this mesh.
    t_start = time.perf_counter()
    restored = checkpointer.restore_latest(compiled.abstract_state, shapes)
    if restored is not None:
        state, start = restored.state, int(restored.state.step)
        logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
        redo = (
            f"; steps {start}..{max(logged)} are recomputed"
            if logged and max(logged) >= start
            else ""
        )
        console.print(
            f"resuming from checkpoint step {restored.step} (written on mesh "
            f"{restored.meta.get('mesh')}) at step {start}{redo}"
        )
    else:
        state, start = compiled.init_fn(), 0
    log = MetricsLog(run_dir / "metrics.jsonl") if jax.process_index() == 0 else None

    peak = hardware.peak_flops(jax.devices()[0], loop.peak_tflops)
    tokens_per_step = data.batch_size * model.seq_len
    global_shape = (data.batch_size, model.seq_len + 1)
    interval = Interval(ckpt, jax.device_count())
    if restored is not None:
        interval.last_saved = restored.step

    def place(s: int) -> jax.Array:
        # Stage 1: each process hands over only its own rows; JAX assembles the global batch.
        return jax.make_array_from_process_local_data(
            compiled.batch_sharding, batches.batch(s), global_shape
        )

    console.print(
        f"[bold]jaxdist[/] {model.name} ({compiled.num_params / 1e6:.2f}M params) on mesh "
        f"{dict(mesh.shape)} x {jax.devices()[0].platform}, steps {start}..{loop.steps - 1}, "
        f"batch {data.batch_size} x {model.seq_len}; run dir {run_dir}"
    )
    step_times: list[float] = []
    saves: list[float] = []
    records: list[dict] = []
    t_prev = time.perf_counter()

    def finish(s: int, metrics: dict) -> dict:
        # Fetching step s's scalars blocks only until step s is done; s+1 is already queued,
        # so the device never idles for logging.
        nonlocal t_prev
        values = {k: float(local_value(v)) for k, v in metrics.items()}
        now = time.perf_counter()
        dt, t_prev = now - t_prev, now
        # The first step compiles, the second's interval holds warm-up, traced steps run
        # synchronously: none of them is a steady-state step time.
        if s >= start + 2 and not capture.traced(s) and not capture.traced(s - 1):
            step_times.append(dt)
        rec = {
            "step": s,
            **values,
            "finite": bool(values["finite"]),
            "step_time_s": dt,
            **throughput(dt, tokens_per_step, model.flops_per_token, jax.device_count(), peak),
        }
        records.append(rec)
        # The recent median: bounded work per step, and it follows a run whose speed drifts.
        recent = step_times[-100:]
        watchdog.finished(s, float(np.median(recent)) if len(recent) >= 3 else None)
        if log and (s % loop.log_every == 0 or s == loop.steps - 1 or not rec["finite"]):
            log.write(rec)
            mfu = f" mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""
            console.print(
                f"step {s:5d}  loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  "
                f"{dt * 1e3:7.1f} ms  {rec['tokens_per_s']:,.0f} tok/s{mfu}",
                highlight=False,
            )
        return rec

    def save(s: int) -> None:
        # Wait for step s itself first: that wait is step time; what follows is the save's.
        nonlocal t_prev
        jax.block_until_ready(state)
        blocked = checkpointer.save(s, state, ckpt_meta)
        t_prev += blocked  # the device idles while the loop is blocked: reported apart
        saves.append(blocked)
        if log:  # per save, so a run that is killed still leaves its save costs behind
            log.write({"event": "save", "step": s, "blocked_s": blocked})
        p50 = float(np.median(step_times)) if step_times else None
        chosen = interval.observe(s, blocked, p50)
        if chosen and log:
            log.write({"event": "checkpoint_interval", "step": s, **chosen})
            console.print(
                f"checkpoint interval (Young-Daly): every {chosen['interval_steps']} "
                f"steps = {chosen['interval_s']:.1f} s, from save cost "
                f"{chosen['save_blocked_s'] * 1e3:.0f} ms and system MTBF "
                f"{chosen['mtbf_system_s'] / 3600:.1f} h",
                highlight=False,
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
    capture = Capture(
        run_dir,
        loop.profile,
        loop.watch_comm,
        loop.watch_every,
        compiled,
        global_shape,
        mesh,
        loop.hardware,
        console,
        log,
    )
    watchdog = Watchdog(Console(stderr=True), loop.slow_step_factor)
    with progress, PreemptionSignal() as signal_flag, watchdog:
        task = progress.add_task("compiling", total=loop.steps, completed=start)
        s = start
        while s < loop.steps:
            if loop.fault_stall and loop.fault_stall[:2] == (s, jax.process_index()):
                time.sleep(loop.fault_stall[2])
            with capture.step(s, state):
                state, metrics = compiled.step_fn(state, place(s))
            capture.after(s, metrics)
            if pending is not None:
                rec = finish(*pending)
                progress.update(task, completed=s, description=f"loss {rec['loss']:.3f}")
                if not rec["finite"]:
                    rolled = _nonfinite(
                        loop.nonfinite, rec["step"], checkpointer, compiled, shapes, console
                    )
                    if rolled is not None:  # drop the step in flight; resume past the bad batch
                        state, s, pending = rolled, rec["step"] + 1, None
                        continue
            pending = (s, metrics)
            stop = signal_flag.stop_at(s)
            if stop or interval.due(s) or s == loop.steps - 1:
                save(s)
            if stop:
                preempted = (s, signal_flag.received)
                break
            s += 1
        if pending is not None:
            rec = finish(*pending)
            if not rec["finite"]:
                _nonfinite(
                    "skip" if loop.nonfinite == "rollback" else loop.nonfinite,
                    rec["step"],
                    checkpointer,
                    compiled,
                    shapes,
                    console,
                )
    capture.close()
    checkpointer.close()  # waits for the last save to commit
    if log:
        log.close()
    if preempted:
        console.print(
            f"{preempted[1]} received: saved step {preempted[0]} and committed it; "
            "rerun the same command to resume"
        )
    stats = distribution(step_times)
    steady = stats.get("p50") or (records[-1]["step_time_s"] if records else float("nan"))
    wall = time.perf_counter() - t_start
    summary = {
        "model": model.name,
        "params": compiled.num_params,
        "mesh": dict(mesh.shape),
        "steps": loop.steps,
        "start_step": start,
        "preempted_at": preempted and preempted[0],
        "final_loss": records[-1]["loss"] if records else None,
        "first_loss": records[0]["loss"] if records else None,
        "skipped_steps": [r["step"] for r in records if not r["finite"]],
        "step_time_s": stats,
        "compile_and_first_step_s": records[0]["step_time_s"] if records else None,
        "checkpoint_blocked_s": distribution(saves),
        "checkpoint_blocked_total_s": sum(saves),
        "checkpoint_fraction_of_wall": sum(saves) / wall,
        "wall_s": wall,
        **throughput(steady, tokens_per_step, model.flops_per_token, jax.device_count(), peak),
        "run_dir": str(run_dir),
    }
    if jax.process_index() == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print_summary(console, summary)
    return summary


def _nonfinite(
    policy: str,
    s: int,
    checkpointer: Checkpointer,
    compiled: Compiled,
    shapes: dict,
    console: Console,
):
    """Applies the non-finite policy to step s, whose update the step itself already skipped.

    Returns the state to continue from for `rollback`, None to go on as before.
    """
    if policy == "stop":
        checkpointer.close()
        raise TrainingStopped(
            f"step {s}: loss or gradient is NaN/Inf and --nonfinite stop was given; the last "
            f"good checkpoint ({checkpointer.steps()[-1] if checkpointer.steps() else 'none'}) "
            "is kept. Lower --lr, or use --nonfinite skip|rollback"
        )
    if policy == "skip":
        console.print(f"[yellow]step {s}: loss or gradient is NaN/Inf; update skipped[/]")
        return None
    checkpointer.wait()
    restored = checkpointer.restore_latest(compiled.abstract_state, shapes)
    if restored is None:
        console.print(
            f"[yellow]step {s}: NaN/Inf and no checkpoint to roll back to; update skipped[/]"
        )
        return None
    console.print(
        f"[yellow]step {s}: NaN/Inf; rolled back to checkpoint step {restored.step}"
        f", skipping batches {int(restored.state.step)}..{s}[/]"
    )
    step = jax.device_put(jnp.int32(s + 1), compiled.state_sharding.step)
    return restored.state._replace(step=step)


def compile_only(compiled: Compiled, batch_size: int, seq_len: int) -> dict:
    """Compiles the step for abstract state and batch; nothing is allocated on the devices."""
    batch = jax.ShapeDtypeStruct(
        (batch_size, seq_len + 1), np.int32, sharding=compiled.batch_sharding
    )
    t0 = time.perf_counter()
    exe = compiled.step_fn.lower(compiled.abstract_state, batch).compile()
    seconds = time.perf_counter() - t0
    mem = exe.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    per_device = {f.removesuffix("_size_in_bytes"): getattr(mem, f, 0) for f in fields}
    per_device["peak_estimate"] = xla_peak(mem)
    mesh = compiled.batch_sharding.mesh
    collectives = hlo.summarize(hlo.collectives(exe.as_text(), dict(mesh.shape)))
    cost = exe.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "compile_s": seconds,
        "platform": mesh.devices.flat[0].platform,
        "device_kind": mesh.devices.flat[0].device_kind,
        "per_device_bytes": per_device,
        "collectives": [
            {"axis": axis, "kind": kind, **v} for (axis, kind), v in sorted(collectives.items())
        ],
        # XLA's own per-device estimate, beside the model's FLOPs for comparison.
        "xla_flops": cost.get("flops"),
        "xla_optimal_seconds": cost.get("optimal_seconds"),
    }
