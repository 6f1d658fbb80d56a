"""`jaxdist eval RUN_DIR`: the held-out loss of a run's newest checkpoint, on any mesh, as one
JSON object (loss, perplexity, tokens and how many are distinct, bits per byte); a warning line
first when the held-out data is smaller than what the evaluation reads."""

import dataclasses
import json
import pathlib
import sys
from typing import Annotated

import tyro

from jaxdist.cli.options import DEFAULT_CACHE, MESH_HELP, Common, setup
from jaxdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Eval:
    """Evaluate a run's newest checkpoint on held-out data."""

    run_dir: tyro.conf.Positional[str]
    data: str | None = None
    """held-out data (a tokenized directory: its eval split, else all of it); default: the
    eval split of the data the run trained on"""
    batches: int | None = None
    """batches of the run's batch size to average over; default: as many as the run's own
    evaluations read (its --eval-batches), so the two losses compare"""
    mesh: Annotated[str, tyro.conf.arg(help=MESH_HELP)] = "auto"
    devices: str = "auto"
    """cpu:N for N fake CPU devices; auto uses the accelerators present, else cpu:8"""
    batch_size: int | None = None
    """default: the run's"""
    compile_cache: str = DEFAULT_CACHE
    """persistent XLA compilation cache directory, or off"""


def _record(run_dir: pathlib.Path) -> dict:
    """The run's config.json, or one line saying it is not a run directory."""
    try:
        return json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{run_dir}/config.json is missing or unreadable ({e}); pass a run directory "
            "made by jaxdist train"
        ) from None


def _held_out(args: Eval, record: dict, held, model, num_batches: int):
    """The held-out batches: --data's eval split (else all of it), or the run's own eval
    split; refused when their tokenizer is not the run's, warned of when too small."""
    import jax

    from jaxdist.data import TokenBatches
    from jaxdist.evaluation import small_data_warning

    try:
        batches = TokenBatches(held, model.seq_len, model.vocab_size, split="eval")
    except ConfigError:
        if args.data is None:
            raise
        batches = TokenBatches(held, model.seq_len, model.vocab_size, split="train")
    trained = record.get("data_source", {})
    if trained.get("tokenizer") not in (None, batches.tokenizer):
        raise ConfigError(
            f"the run was trained on tokenizer {trained['tokenizer']!r} data, --data holds "
            f"{batches.tokenizer!r}; evaluate on data made with the run's tokenizer"
        )
    warning = small_data_warning(batches, num_batches, "--batches")
    if warning and jax.process_index() == 0:
        print(f"jaxdist: warning: {warning}", file=sys.stderr)
    return batches


def evaluate(args: Eval) -> int:
    run_dir = pathlib.Path(args.run_dir)
    record = _record(run_dir)
    num_batches = args.batches
    if num_batches is None:
        num_batches = record.get("eval", {}).get("eval_batches", 20)
    if num_batches < 1:
        raise ConfigError(f"--batches {num_batches} must be at least 1")
    batch_size = args.batch_size or record["data"]["batch_size"]
    common = Common(
        mesh=args.mesh,
        devices=args.devices,
        batch_size=batch_size,
        compile_cache=args.compile_cache,
    )
    mesh, layout, platform_cfg, _ = setup(common)
    rules = layout.rules

    import jax

    from jaxdist.checkpoint.store import restore
    from jaxdist.cluster.join import process_rows
    from jaxdist.config import DataConfig, OptimConfig
    from jaxdist.evaluation import evaluate, report
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.optim import make_optimizer
    from jaxdist.parallel import replica
    from jaxdist.step import Vocab, build
    from models.presets import from_record, model_spec

    # The recorded model, computed as this platform computes (dtype, attention kernel).
    model_cfg = dataclasses.replace(
        from_record(record["model"]),
        compute_dtype=platform_cfg.compute_dtype,
        attention=platform_cfg.attention,
    )
    model = model_spec(model_cfg)
    held = DataConfig(
        path=args.data or record["data"]["path"],
        batch_size=batch_size,
        seed=record["data"]["seed"],
    )
    batches = _held_out(args, record, held, model, num_batches)
    # The optimizer's structure must match the checkpoint's, though only parameters are used.
    tx, lr = make_optimizer(OptimConfig(**record["optim"]), record["loop"]["steps"])
    step_cfg = StepConfig(
        document_mask=record["step"].get("document_mask", True),
        **StepConfig.recorded_state(record["step"]),  # --fp8 delayed: its state's shape
    )
    vocab = Vocab(batches.vocab_size, batches.eos_id)
    sync = replica.recorded(record, mesh.shape, run_dir)  # replica groups: the outer weights
    layout = Layout.on(
        mesh, rules, step_cfg, batch_size=batch_size, seq_len=model.seq_len, sync=sync
    )
    jitted = build(model.init, tx, lr, layout, mesh, vocab=vocab)
    batches = batches.for_rows(process_rows(jitted.batch_sharding, (batch_size, model.seq_len + 1)))
    restored = restore(run_dir, jitted.abstract_state)
    if restored is None:
        raise ConfigError(f"{run_dir} holds no valid checkpoint to evaluate")
    loss = evaluate(jitted, jitted.weights(restored.state), batches, range(num_batches))
    # The checkpoint's step, as train names it (checkpoint 299, "eval loss (step 299)"), not
    # the state's count of updates (300).
    out = {"run_dir": str(run_dir), "step": restored.step}
    out |= report(loss, batches, num_batches)
    out |= {"mesh": dict(mesh.shape), "data": held.path or "embedded"}
    if jax.process_index() == 0:
        print(json.dumps(out))
    return 0
