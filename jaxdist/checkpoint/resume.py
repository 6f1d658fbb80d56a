"""The run directory's record (stage 5, recover): config.json, and the check a resume must pass
against its checkpoint's record (the same model, data stream, optimizer, replica groups and FP8
recipe). Restoring the state itself is the loop's: jaxdist.attempt.restore_or_init."""

import contextlib
import contextvars
import dataclasses
import json
import pathlib
import shlex
from typing import Any

import jax

from jaxdist.errors import ConfigError


def _as_record(obj) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


# What the model is and what the data stream is: a resume must keep these, or the checkpoint's
# weights would meet another model, or step s would read another batch than it did.
FIXED = (
    "model.name",
    "model.style",
    "model.num_layers",
    "model.d_model",
    "model.num_heads",
    "model.num_kv_heads",
    "model.d_mlp",
    "model.vocab_size",
    "model.seq_len",
    "model.rope_theta",
    "model.norm_eps",
    "model.num_experts",
    "model.top_k",
    "data.batch_size",
    "data.seed",
    "loop.seed",
    "data_source.fingerprint",  # the data itself, wherever it lies (data.path may move)
    "data_source.tokenizer",
    "data_source.sources",
    "optim.optimizer",  # another optimizer cannot read this one's state
    # Replica groups: their number and rounds decide what each group's state is.
    "mesh.replica",
    "sync.sync_every",
    # FP8 changes every step's numerics, and --fp8 delayed the state's structure.
    "step.fp8",
)
# With --fp8 delayed, which projections hold an amax history and its length are the state's
# shapes too.
FIXED_DELAYED = ("step.fp8_history", "step.fp8_filter")
# Bookkeeping, not configuration: never reported as changed.
_UNREPORTED = ("versions", "cli", "loop.run_dir", "data_source.eos_id", "rules")


# How the "changed on resume" line names a field: by its config path, or by `name(path)` inside
# `fields_named(name)`: the CLI names its flags there (the library does not know them).
_FIELD_NAME: contextvars.ContextVar = contextvars.ContextVar("field_name", default=None)


@contextlib.contextmanager
def fields_named(name):
    """Within: the "changed on resume" line names each field `name(path)` (a flag)."""
    token = _FIELD_NAME.set(name)
    try:
        yield
    finally:
        _FIELD_NAME.reset(token)


class ResumeRefused(ConfigError):
    """A resume whose model, data stream, optimizer, replica groups or FP8 recipe differs from
    its checkpoint's. `changes`: (config path, old, new) each; the message names the paths, and
    `worded(name)` names them as `name` does (the CLI: by their flags, `--sync-every 8 -> 32`)."""

    def __init__(self, run_dir: pathlib.Path, step: int, changes: list[tuple[str, Any, Any]]):
        self.run_dir, self.step, self.changes = run_dir, step, changes
        super().__init__(self.worded(lambda path: path))

    def worded(self, name) -> str:
        said = (f"{name(k)} {old!r} -> {new!r}" for k, old, new in self.changes)
        changed = "; ".join(dict.fromkeys(said))  # two fields of one flag (--seed): once
        return (
            f"{self.run_dir} holds a checkpoint (step {self.step}) of another model, data "
            f"stream, optimizer, replica groups or FP8 recipe: {changed}. These decide what the "
            "model is, which batch each step reads and what the state holds and computes, so "
            "the run cannot resume with them changed: use a new --run-dir for a new run, or "
            "give the old values to resume this one"
        )


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _checkpointed_record(run_dir: pathlib.Path) -> tuple[int, dict] | None:
    """The newest checkpoint's record of its run's config (what a resume restores)."""
    directory = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())
    for step in reversed(steps):
        try:
            meta = json.loads((directory / str(step) / "meta" / "metadata").read_text())
            return step, meta["config"]
        except (OSError, KeyError, ValueError):
            continue  # restore_latest sets an unreadable checkpoint aside
    return None


def rerun_hint(run_dir: pathlib.Path) -> str:
    """How to resume this run: its directory, exactly. A run started without --run-dir got a
    new directory of its own (runs/<time>), so "the same command" alone would start over."""
    return f"rerun the same command with --run-dir {shlex.quote(str(run_dir))}"


def finished_step(run_dir: pathlib.Path, steps: int) -> int | None:
    """The newest checkpoint's step when it is the last of `steps` or later (the run has
    nothing left to do), else None; read from its record alone, before anything is built."""
    found = _checkpointed_record(run_dir)
    return found[0] if found is not None and found[0] >= steps - 1 else None


def compare_with_checkpoint(run_dir: pathlib.Path, record: dict) -> list[str]:
    """Stops a resume whose model or data stream differs from the checkpoint's, naming each
    field (old -> new) and the way out; returns the other fields that changed, for the log."""
    found = _checkpointed_record(run_dir)
    if found is None:
        return []
    step, old_record = found
    old, new = _flat(old_record), _flat(record)
    keys = FIXED + (FIXED_DELAYED if old.get("step.fp8") == "delayed" else ())
    fixed = [(k, old[k], new.get(k)) for k in keys if k in old and old[k] != new.get(k)]
    if fixed:
        raise ResumeRefused(run_dir, step, fixed)
    return [
        f"{k} {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and not k.startswith(_UNREPORTED)
    ]


def _worded(changed: list[str]) -> str:
    """The changed fields ("path old -> new" each), named as `fields_named` says: a flag two
    fields share (--seed: data.seed, loop.seed) once."""
    name = _FIELD_NAME.get()
    if name is not None:
        changed = [" ".join((name(c.split(" ", 1)[0]), c.split(" ", 1)[1])) for c in changed]
    return "; ".join(dict.fromkeys(changed))


def run_record(model, mesh, rules, config, data: dict | None = None, extra: dict | None = None):
    """Everything that decides what a run computes, and where; `extra` joins it (the command
    line's config tree, under `cli`)."""
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
        **(extra or {}),
    }
    return json.loads(json.dumps(record))  # as it reads back: tuples become lists


def write_record(
    run_dir: pathlib.Path,
    model,
    mesh,
    rules,
    config,
    data: dict | None = None,
    extra: dict | None = None,
    console=None,
) -> dict:
    """The run's config.json (`run_record`). A resume is checked against the checkpoint's
    record first (`compare_with_checkpoint`), before anything is written; every attempt's
    record is kept in attempts/, config.json is the latest."""
    record = run_record(model, mesh, rules, config, data, extra)
    changed = compare_with_checkpoint(run_dir, record)
    if changed and console is not None:
        console.print(f"changed on resume: {_worded(changed)}", highlight=False)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            attempts = run_dir / "attempts"
            attempts.mkdir(exist_ok=True)
            n = len(list(attempts.glob("*.json")))
            text = json.dumps({**record, "changed_on_resume": changed}, indent=2)
            (attempts / f"{n:03d}.json").write_text(text)
            (run_dir / "config.json").write_text(json.dumps(record, indent=2))
    except OSError as e:
        raise ConfigError(
            f"cannot write run directory {run_dir}: {e.strerror}; pass a writable --run-dir"
        ) from None
    return record


def outer_step_for_run(config, replicas: int) -> tuple:
    """A run's config with its outer step resolved (jaxdist.parallel.rounds.resolved: the steps
    it runs, or the choice its checkpoint recorded when it resumes) and the header's line;
    (config, None) without replica groups."""
    if config.sync is None:
        return config, None
    from jaxdist.parallel.rounds import resolved

    run_dir = config.loop.run_dir
    found = _checkpointed_record(pathlib.Path(run_dir)) if run_dir else None
    recorded = found[1].get("sync") if found else None
    sync, line = resolved(config.sync, config.loop.steps, replicas, recorded)
    return dataclasses.replace(config, sync=sync), line
