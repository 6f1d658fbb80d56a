"""`jaxdist train`: the loop over the library's own configs, or the step compiled ahead of time
(`--compile-only`, also for a TPU target this host does not have)."""

import dataclasses
import shlex

import tyro

from jaxdist.checkpoint.interval import CheckpointConfig
from jaxdist.cli.options import Common, check_host_memory, setup
from jaxdist.cluster.join import DistributedConfig
from jaxdist.config import EvalConfig, LoopConfig, OptimConfig
from jaxdist.hf.source import hf_dir


@dataclasses.dataclass(frozen=True)
class Train(Common):
    """Train a model (the default: tiny on 8 fake CPU devices, embedded corpus)."""

    config: str | None = None
    """a YAML, TOML or JSON file holding this config tree (a run's config.json replays the
    run); flags given beside it override it"""

    loop: tyro.conf.OmitArgPrefixes[LoopConfig] = LoopConfig()
    optim: tyro.conf.OmitArgPrefixes[OptimConfig] = OptimConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    cluster: tyro.conf.OmitArgPrefixes[DistributedConfig] = DistributedConfig()
    eval: tyro.conf.OmitArgPrefixes[EvalConfig] = EvalConfig()
    data: str | None = None
    """a tokenized directory (jaxdist tokenize), a mixture NAME=DIR:WEIGHT,..., or a text or
    JSONL file or directory read as bytes; default: Python's stdlib sources"""
    init_from: str | None = None
    """hf:PATH: start from a local Hugging Face model's weights (its architecture, a fresh
    optimizer, step 0); train data tokenized with its tokenizer.json"""
    compile_only: bool = False
    """compile the step for abstract inputs and report per-device memory; no training"""
    target: str | None = None
    """with --compile-only: compile for hardware this host does not have: a TPU slice, e.g.
    v5p-128 or tpu-v5p:4x4x4 (pip install 'jaxdist[tpu]'), or GPUs, h100:8, h200:1, h100:2x8
    (hosts x GPUs; pip install 'jaxdist[gpu-aot]')"""
    json: str | None = None
    """with --compile-only: write the whole compile report as JSON to this file (-: to stdout,
    instead of the table)"""


def run(args: Train) -> int:
    from jaxdist.errors import ConfigError

    if args.target and not args.compile_only:
        raise ConfigError("--target compiles only; add --compile-only")
    if args.json and not args.compile_only:
        raise ConfigError("--json writes the compile report; add --compile-only")
    args.loop.validate()
    args.checkpoint.validate()
    args.eval.validate()
    init = None
    if args.init_from:
        from jaxdist.cli.pretrained import init_from

        args, init = init_from(args)
    mesh, layout, model_cfg, args = setup(
        args,
        profiling=bool(args.loop.profile or args.loop.watch_comm),
        cluster=args.cluster,
        target=args.target,
        data=args.data,
    )
    check_host_memory(mesh, layout, model_cfg, runs=not args.compile_only)
    from jaxdist import train as loop
    from jaxdist.config import DataConfig, RunConfig
    from jaxdist.data.batches import data_vocab
    from models.presets import model_spec

    # The data decides the vocabulary (setup gave the model the data's; the preset's is for
    # bytes or GPT-2's tokens); a pretrained architecture keeps its own, checked here.
    vocab_size, eos_id = data_vocab(args.data)
    hf_path = hf_dir(args.model)
    if hf_path is not None:
        from jaxdist.hf.init_from import check_data
        from models.hf_adapter import ADAPTER

        hf_model = init or ADAPTER.open(hf_path)
        check_data(hf_model, args.data, vocab_size, pretrained=init is not None)
    model = model_spec(model_cfg)
    if args.compile_only:
        from jaxdist.cli.compile_report import compile_only

        if args.data is None:  # no data: the loss covers the model's own vocabulary
            vocab_size = _own_vocab(args.model, model)
        return compile_only(args, model_cfg, mesh, layout, (vocab_size, eos_id))
    data = DataConfig(path=args.data, batch_size=args.batch_size, seed=args.loop.seed)
    config = RunConfig(
        args.optim, data, args.step, args.loop, args.checkpoint, args.eval, layout.sync
    )
    record = {"cli": dataclasses.asdict(args)}
    first = None
    if init is not None:  # the run's record names the weights it started from
        from jaxdist.hf.init_from import initial_state
        from jaxdist.hf.safetensors_io import SafetensorsDir
        from models.hf_adapter import ADAPTER

        record["init_from"] = {**init.record(), "dtype": SafetensorsDir(init.path).dtype()}
        first = initial_state(ADAPTER, init)
    from jaxdist.checkpoint.resume import fields_named
    from jaxdist.cli.config_file import flag_of

    # What changed on a resume is said by the flags that changed it, as a refusal is.
    with fields_named(lambda path: flag_of(path, type(args))):
        summary = loop.fit(model, mesh, layout.rules, config, record=record, init_state=first)
    import jax

    if jax.process_index() == 0 and "already_finished" not in summary:
        # Commands, so the command line says them (fit's Python callers have their own).
        print(_next_commands(summary, args))
    return 0


def _next_commands(summary: dict, args: Train) -> str:
    """What a user does after a run: train further (with the run's own flags), evaluate (a run
    with held-out data: it evaluated), export."""
    from jaxdist.cli.config_file import command_line

    where = shlex.quote(summary["run_dir"])
    own = shlex.join(command_line(args, skip=("loop.run_dir", "loop.steps")))
    further = f"jaxdist train --run-dir {where} --steps {args.loop.steps * 2} {own}".strip()
    lines = [f"next: train further  {further}"]
    if "eval_loss" in summary:
        lines.append(f"      evaluate       jaxdist eval {where}")
    lines.append(f"      export         jaxdist export-hf {where} {where}/hf")
    return "\n".join(lines)


def _own_vocab(name: str, model) -> int:
    """The vocabulary a model's own tokens use: a Hugging Face architecture's (before our
    padding to a multiple of 128), else the model's."""
    hf_path = hf_dir(name)
    if hf_path is not None:
        from models.hf_adapter import ADAPTER

        return ADAPTER.open(hf_path).vocab_size
    return model.vocab_size
