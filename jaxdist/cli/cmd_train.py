"""`jaxdist train`: the loop over the library's own configs, or the step compiled ahead of time
(`--compile-only`, also for a TPU target this host does not have)."""

import dataclasses
import json

import tyro

from jaxdist.checkpoint.interval import CheckpointConfig
from jaxdist.cli.options import Common, check_host_memory, setup
from jaxdist.cluster.join import DistributedConfig
from jaxdist.evaluation import EvalConfig
from jaxdist.optim import OptimConfig
from jaxdist.train import LoopConfig


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
    tpu-v5p:4x4x4 (pip install 'jaxdist[tpu]'), or GPUs, h100:8, h200:1, h100:2x8 (hosts x
    GPUs; pip install 'jaxdist[gpu-aot]')"""


def run(args: Train) -> int:
    from jaxdist.errors import ConfigError

    if args.target and not args.compile_only:
        raise ConfigError("--target compiles only; add --compile-only")
    args.loop.validate()
    args.checkpoint.validate()
    args.eval.validate()
    init = None
    if args.init_from:
        from jaxdist.hf.init_from import init_from
        from models.hf_family import FAMILY

        args, init = init_from(FAMILY, args)
    mesh, rules, model_cfg, args = setup(
        args,
        profiling=bool(args.loop.profile or args.loop.watch_comm),
        cluster=args.cluster,
        target=args.target,
    )
    check_host_memory(args, model_cfg, mesh, rules, args.data, runs=not args.compile_only)
    from jaxdist import train as loop
    from jaxdist.data import DataConfig
    from jaxdist.data.batches import data_vocab
    from models.presets import model_spec, with_data_vocab

    # The data decides the vocabulary (the preset's is for bytes or GPT-2's tokens).
    vocab_size, eos_id = data_vocab(args.data)
    if args.model.startswith("hf:"):  # a pretrained architecture keeps its vocabulary
        from jaxdist.hf.init_from import hf_vocab
        from models.hf_family import FAMILY

        hf_vocab(FAMILY, args.model, args.data, vocab_size, init is not None)
        model = model_spec(model_cfg)
    else:
        model = model_spec(with_data_vocab(model_cfg, vocab_size))
    if args.compile_only:
        if args.data is None:  # no data: the loss covers the model's own vocabulary
            vocab_size = _own_vocab(args.model, model)
        return _compile_only(args, model, mesh, rules, vocab_size, eos_id)
    data = DataConfig(path=args.data, batch_size=args.batch_size, seed=args.loop.seed)
    config = loop.RunConfig(args.optim, data, args.step, args.loop, args.checkpoint, args.eval)
    record = {"cli": dataclasses.asdict(args)}
    first = None
    if init is not None:  # the run's record names the weights it started from
        from jaxdist.hf.init_from import initial_state
        from jaxdist.hf.safetensors_io import SafetensorsDir
        from models.hf_family import FAMILY

        record["init_from"] = {**init.record(), "dtype": SafetensorsDir(init.path).dtype()}
        first = initial_state(FAMILY, init, args.optim, args.loop.steps)
    loop.fit(model, mesh, rules, config, record=record, init_state=first)
    return 0


def _own_vocab(name: str, model) -> int:
    """The vocabulary a model's own tokens use: a Hugging Face architecture's (before our
    padding to a multiple of 128), else the model's."""
    if name.startswith("hf:"):
        from models.hf_family import FAMILY

        return FAMILY.open(name).vocab_size
    return model.vocab_size


def _compile_only(args: Train, model, mesh, rules, vocab_size, eos_id) -> int:
    """Compiles the step and prints XLA's report; with --remat auto and a --target, a policy
    the compiler refuses (or whose peak does not fit the chip) gives way to the next one."""
    import dataclasses

    from jaxdist.cli.remat_auto import order, target_hardware
    from jaxdist.errors import ConfigError
    from jaxdist.planning.aot import target_fit
    from jaxdist.planning.fit import next_policy, refused_for_memory
    from models.presets import model_spec

    auto = args.remat == "auto" and args.target is not None
    tried, policies = [], order()
    while True:
        tried.append(model.config.remat)
        try:
            report = _compile_report(args, model, mesh, rules, vocab_size, eos_id)
        except Exception as e:  # XLA's TPU compiler refuses a step that cannot fit the chip
            if not refused_for_memory(e):
                raise
            report, refusal = None, str(e).splitlines()[0][:200]
        if report is not None and args.target:
            hardware = target_hardware(args.target)
            report |= target_fit(hardware, report, model, args.batch_size, mesh.size)
        leaner = next_policy(policies, tried[-1])
        if not auto or leaner is None or (report is not None and report["fits"]):
            break
        model = model_spec(dataclasses.replace(model.config, remat=leaner))
    if report is None:
        leaner = "" if auto else ", a leaner --remat (or auto)"
        raise ConfigError(
            f"XLA refused the step for lack of memory at every policy tried ({', '.join(tried)}): "
            f"{refusal}; use a smaller --batch-size{leaner} or a mesh that shards more "
            "(a context axis splits long rows)"
        )
    report["remat"] = {"policy": tried[-1], "tried": tried} if auto else model.config.remat
    print(json.dumps(report))
    return 0


def _compile_report(args: Train, model, mesh, rules, vocab_size, eos_id) -> dict:
    from jaxdist.optim import make_optimizer
    from jaxdist.planning.aot import compile_only
    from jaxdist.step import Vocab, build

    # No data read: the batch is abstract (and a target's hosts are not this one).
    tx, lr = make_optimizer(args.optim, args.loop.steps)
    vocab = Vocab(vocab_size, eos_id)
    jitted = build(
        model.init,
        tx,
        lr,
        rules,
        mesh,
        args.step,
        args.loop.seed,
        args.batch_size,
        vocab,
        model.seq_len,
    )
    report = compile_only(jitted, args.batch_size, model.seq_len)
    report |= {"model": model.name, "params": jitted.num_params, "mesh": dict(mesh.shape)}
    return report | {"loss_vocab": vocab_size}  # the ids the loss may predict
