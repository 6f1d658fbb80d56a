"""The run directory's record and resuming from it (stage 5, recover): config.json, the data
check a resume must pass, and the newest good checkpoint or a fresh state."""

import dataclasses
import json
import pathlib
from typing import Any

import jax

from jaxdist.checkpoint.store import Checkpointer
from jaxdist.errors import ConfigError
from jaxdist.metrics import read_metrics
from jaxdist.step import Compiled


def _as_record(obj) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def write_record(
    run_dir: pathlib.Path, model, mesh, rules, config, data: dict | None = None
) -> dict:
    """The run's config.json: everything that decides what it computes, and where."""
    record = {
        "model": {"name": model.name, **(_as_record(model.config) or {})},
        "data_source": data or {},
        "mesh": dict(mesh.shape),
        "rules": [list(r) for r in rules.rows],
        **dataclasses.asdict(config),
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
            (run_dir / "config.json").write_text(json.dumps(record, indent=2))
    except OSError as e:
        raise ConfigError(
            f"cannot write run directory {run_dir}: {e.strerror}; pass a writable --run-dir"
        ) from None
    return record


def check_resume_data(checkpointer: Checkpointer, data: dict) -> None:
    """A resume must read the data it was trained on: another dataset or tokenizer would give
    other batches under the same step numbers. Checked on the newest checkpoint's record,
    before anything is compiled or restored."""
    steps = checkpointer.steps()
    if not steps:
        return
    try:
        old = checkpointer.read_meta(steps[-1])["config"].get("data_source")
    except (OSError, KeyError, ValueError):
        return  # an unreadable record: restore_latest sets that checkpoint aside
    if not old:
        return
    changed = [
        f"{k} {old.get(k)!r} -> {data.get(k)!r}"
        for k in ("tokenizer", "vocab_size", "eos_id", "fingerprint", "sources")
        if old.get(k) != data.get(k)
    ]
    if changed:
        raise ConfigError(
            f"the run in {checkpointer.directory.parent} was trained on other data than "
            f"--data gives ({'; '.join(changed)}); pass the data it was trained on, or "
            "start a new run (another --run-dir)"
        )


def restore_or_init(checkpointer: Checkpointer, compiled: Compiled, shapes, run_dir, console):
    """Stage 5, recover: the newest checkpoint that reads and verifies, resharded onto this
    mesh, or a fresh state. Returns (state, first step to run, the restored checkpoint)."""
    restored = checkpointer.restore_latest(compiled.abstract_state, shapes)
    if restored is None:
        return compiled.init_fn(), 0, None
    start = int(restored.state.step)
    logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    redo = (
        f"; steps {start}..{max(logged)} are recomputed" if logged and max(logged) >= start else ""
    )
    console.print(
        f"resuming from checkpoint step {restored.step} (written on mesh "
        f"{restored.meta.get('mesh')}) at step {start}{redo}"
    )
    return restored.state, start, restored
