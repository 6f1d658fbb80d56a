"""`jaxdist eval RUN_DIR`: the held-out loss of a run's newest checkpoint, on any mesh, as one
line (loss, perplexity, bits per byte, tokens and how many are distinct), or with --json one
JSON object for scripts; a warning line first when the held-out data is smaller than what the
evaluation reads."""

import dataclasses
import json
import pathlib
import sys
from typing import Annotated

import tyro

from jaxdist.cli.options import DEFAULT_CACHE, MESH_HELP, Common, computes, devices_and_mesh
from jaxdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Eval:
    """Evaluate a run's newest checkpoint on held-out data."""

    run_dir: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="RUN_DIR")]
    """a run directory (train's --run-dir); its newest good checkpoint is evaluated"""
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
    json: bool = False
    """print one JSON object (run_dir, step, loss, perplexity, tokens, distinct_tokens,
    bits_per_byte, batches, distinct_windows, mesh, data) instead of the line"""


def said(out: dict) -> str:
    """The evaluation as a person reads it, one line from the figures --json prints."""
    bpb = out["bits_per_byte"]
    distinct = out["distinct_tokens"]
    repeats = "" if distinct == out["tokens"] else f" ({distinct:,} distinct)"
    mesh = ",".join(f"{k}={v}" for k, v in out["mesh"].items() if v > 1) or "one device"
    return (
        f"eval {out['run_dir']} step {out['step']}: loss {out['loss']:.4f}  perplexity "
        f"{out['perplexity']:.2f}"
        + (f"  {bpb:.3f} bits/byte" if bpb is not None else "")
        + f"  over {out['tokens']:,} tokens{repeats} of {out['data']}, {out['batches']} "
        f"batches on {mesh}"
    )


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
    from jaxdist.inference import runs  # what runs is imported when it runs (not for --help)

    run_dir = pathlib.Path(args.run_dir)
    record = runs.read_record(run_dir)
    num_batches = args.batches
    if num_batches is None:
        num_batches = record.get("eval", {}).get("eval_batches", 20)
    if num_batches < 1:
        raise ConfigError(f"--batches {num_batches} must be at least 1")
    batch_size = args.batch_size or record["data"]["batch_size"]
    common = Common(mesh=args.mesh, devices=args.devices, compile_cache=args.compile_cache)
    mesh, rules, platform = devices_and_mesh(common)

    import jax

    from jaxdist.cluster.join import process_rows
    from jaxdist.config import DataConfig
    from jaxdist.evaluation import evaluate, report
    from jaxdist.kernels.loss import Vocab
    from models.presets import from_record, model_spec

    # The recorded model, computed as this platform computes (dtype, attention kernel).
    compute_dtype, attention = computes(platform)
    model_cfg = from_record(record["model"])
    model_cfg = dataclasses.replace(model_cfg, compute_dtype=compute_dtype, attention=attention)
    model = model_spec(model_cfg)
    held = DataConfig(
        path=args.data or record["data"]["path"],
        batch_size=batch_size,
        seed=record["data"]["seed"],
    )
    batches = _held_out(args, record, held, model, num_batches)
    run = runs.open_run(run_dir, model, mesh, rules)
    forward = run.forward(Vocab(batches.vocab_size, batches.eos_id), batch_size)
    shape = (batch_size, model.seq_len + 1)
    batches = batches.for_rows(process_rows(forward.batch_sharding, shape))
    loss = evaluate(forward, run.params, batches, range(num_batches))
    # The checkpoint's step, as train names it (checkpoint 299, "eval loss (step 299)"), not
    # the state's count of updates (300).
    out = {"run_dir": str(run_dir), "step": run.step}
    out |= report(loss, batches, num_batches)
    out |= {"mesh": dict(mesh.shape), "data": held.path or "embedded"}
    if jax.process_index() == 0:
        print(json.dumps(out) if args.json else said(out))
    return 0
