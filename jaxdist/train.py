"""The training loop: plain code, top to bottom, one jitted step.

Stages of a step as they appear below: (1) distribute work: build the mesh layout and place
each batch by the rules; (2) compute and (4) synchronize: the jitted `train_step`; (3) move
tensors: the collectives XLA compiled into it; (5) checkpoint: a later issue.
"""

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from jaxdist import hardware
from jaxdist.data import DataConfig, TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.metrics import MetricsLog, distribution, throughput
from jaxdist.optim import OptimConfig, make_optimizer, schedule
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
    batches = TokenBatches(
        data, model.seq_len, model.vocab_size, jax.process_index(), jax.process_count()
    )
    tx = make_optimizer(optim, loop.steps)
    compiled = build(model.init, tx, rules, mesh, step, loop.seed, data.batch_size)
    return compiled, batches


def run(
    model: ModelSpec,
    mesh: Mesh,
    rules: AxisRules,
    optim: OptimConfig,
    data: DataConfig,
    step: StepConfig,
    loop: LoopConfig,
    console: Console | None = None,
) -> dict:
    """Trains for loop.steps steps; returns the summary that is also written to summary.json."""
    console = console or Console(stderr=True)
    compiled, batches = prepare(model, mesh, rules, optim, data, step, loop)
    run_dir = pathlib.Path(loop.run_dir or time.strftime("runs/%Y%m%d-%H%M%S"))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(
            json.dumps(
                {
                    "model": {"name": model.name, **_record(model.config)},
                    "mesh": dict(mesh.shape),
                    "rules": [list(r) for r in rules.rows],
                    "optim": _record(optim),
                    "data": _record(data),
                    "step": _record(step),
                    "loop": _record(loop),
                    "devices": {
                        "count": jax.device_count(),
                        "kind": jax.devices()[0].device_kind,
                        "processes": jax.process_count(),
                    },
                    "versions": {"jax": jax.__version__},
                },
                indent=2,
            )
        )
    except OSError as e:
        raise ConfigError(
            f"cannot write run directory {run_dir}: {e.strerror}; pass a writable --run-dir"
        ) from None
    log = MetricsLog(run_dir / "metrics.jsonl") if jax.process_index() == 0 else None

    peak = hardware.peak_flops(jax.devices()[0], loop.peak_tflops)
    tokens_per_step = data.batch_size * model.seq_len
    lr_at = schedule(optim, loop.steps)
    global_shape = (data.batch_size, model.seq_len + 1)

    def place(s: int) -> jax.Array:
        # Stage 1: each process hands over only its own rows; JAX assembles the global batch.
        return jax.make_array_from_process_local_data(
            compiled.batch_sharding, batches.batch(s), global_shape
        )

    console.print(
        f"[bold]jaxdist[/] {model.name} ({compiled.num_params / 1e6:.2f}M params) on mesh "
        f"{dict(mesh.shape)} x {jax.devices()[0].platform}, {loop.steps} steps, batch "
        f"{data.batch_size} x {model.seq_len}; run dir {run_dir}"
    )
    t_start = time.perf_counter()
    state = compiled.init_fn()
    step_times: list[float] = []
    records: list[dict] = []
    pending: tuple[int, dict] | None = None
    t_prev = time.perf_counter()

    def finish(s: int, metrics: dict) -> None:
        # Fetching step s's scalars blocks only until step s is done; s+1 is already queued,
        # so the device never idles for logging.
        nonlocal t_prev
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        dt, t_prev = now - t_prev, now
        if s >= 2:  # step 0 compiles; step 1's interval still holds dispatch warm-up
            step_times.append(dt)
        rec = {
            "step": s,
            **values,
            "lr": float(lr_at(s)),
            "step_time_s": dt,
            **throughput(dt, tokens_per_step, model.flops_per_token, jax.device_count(), peak),
        }
        records.append(rec)
        if log and (s % loop.log_every == 0 or s == loop.steps - 1):
            log.write(rec)
            mfu = f" mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""
            console.print(
                f"step {s:5d}  loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  "
                f"{dt * 1e3:7.1f} ms  {rec['tokens_per_s']:,.0f} tok/s{mfu}",
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
    with progress:
        task = progress.add_task("compiling", total=loop.steps)
        for s in range(loop.steps):
            state, metrics = compiled.step_fn(state, place(s))
            if pending is not None:
                finish(*pending)
                progress.update(task, completed=s, description=f"loss {records[-1]['loss']:.3f}")
            pending = (s, metrics)
        finish(*pending)
    jax.block_until_ready(state)
    wall = time.perf_counter() - t_start
    if log:
        log.close()

    stats = distribution(step_times)
    steady = stats.get("p50") or records[-1]["step_time_s"]
    summary = {
        "model": model.name,
        "params": compiled.num_params,
        "mesh": dict(mesh.shape),
        "steps": loop.steps,
        "final_loss": records[-1]["loss"],
        "first_loss": records[0]["loss"],
        "step_time_s": stats,
        "compile_and_first_step_s": records[0]["step_time_s"],
        "wall_s": wall,
        **throughput(steady, tokens_per_step, model.flops_per_token, jax.device_count(), peak),
        "run_dir": str(run_dir),
    }
    if jax.process_index() == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        _print_summary(console, summary)
    return summary


def _print_summary(console: Console, s: dict) -> None:
    table = Table(title=f"{s['model']} on {s['mesh']}", show_header=False)
    st = s["step_time_s"]
    rows = [
        ("loss", f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}"),
        (
            "step time p50 / p90 / max",
            f"{st.get('p50', 0) * 1e3:.1f} / {st.get('p90', 0) * 1e3:.1f} / "
            f"{st.get('max', 0) * 1e3:.1f} ms"
            if st
            else "n/a (too few steps)",
        ),
        ("tokens/s (p50 step)", f"{s['tokens_per_s']:,.0f}"),
        ("model TFLOP/s", f"{s['model_tflops']:.3f}"),
        ("MFU", f"{s['mfu']:.1%}" if s["mfu"] is not None else "n/a (unknown peak; --peak-tflops)"),
        ("compile + first step", f"{s['compile_and_first_step_s']:.1f} s"),
        ("wall", f"{s['wall_s']:.1f} s"),
        ("run dir", s["run_dir"]),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


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
    # Donated state aliases its output, so it is counted once.
    per_device["peak_estimate"] = (
        per_device["argument"] + per_device["output"] - per_device["alias"] + per_device["temp"]
    )
    return {"compile_s": seconds, "per_device_bytes": per_device}
