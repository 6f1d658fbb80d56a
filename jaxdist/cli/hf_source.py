"""Where a model comes from, for `generate`, `export-hf` and `train --init-from`: a run's
checkpoint restored onto a mesh (any mesh: it is resharded), or a local Hugging Face directory
(`hf:PATH`) read straight into one (models/hf.py); with the vocabulary, EOS and tokenizer that
go with it. Everything a user can get wrong is checked before anything compiles."""

import dataclasses
import json as jsonlib
import pathlib
from typing import NamedTuple

from jaxdist.cli.options import Common, setup
from jaxdist.errors import ConfigError

TOKENIZER = "tokenizer.json"


class Source(NamedTuple):
    """A model ready to use: its config, parameters on the mesh, and its vocabulary."""

    config: object  # models.transformer.TransformerConfig
    params: dict  # name -> global jax array
    mesh: object
    rules: object
    vocab_size: int  # the real vocabulary (ids past it are padding)
    eos_id: int | None
    tokenizer: pathlib.Path | None  # tokenizer.json; None: UTF-8 bytes
    hf_config: dict | None  # the Hugging Face config the model came from
    source_dir: pathlib.Path | None  # the Hugging Face directory it came from
    dtype: str  # the source weights' dtype


def read_record(run_dir: pathlib.Path) -> dict:
    try:
        return jsonlib.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{run_dir}/config.json is missing or unreadable ({e}); pass a run directory made by "
            "jaxdist train, or hf:PATH for a Hugging Face model directory"
        ) from None


def _eos(hf: dict, directory: pathlib.Path | None) -> int | None:
    gen = {}
    if directory is not None and (directory / "generation_config.json").is_file():
        gen = jsonlib.loads((directory / "generation_config.json").read_text())
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    return eos[0] if isinstance(eos, list) else eos


def check_source(source: str) -> None:
    """What can be wrong with the source, found before any device starts."""
    if source.startswith("hf:"):
        from jaxdist.hf.safetensors_io import SafetensorsDir
        from models.hf import check_weights, open_model

        model = open_model(source)
        check_weights(model, SafetensorsDir(model.path).tensors)
        return
    run_dir = pathlib.Path(source)
    read_record(run_dir)
    steps = [p for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]
    if not steps:
        raise ConfigError(
            f"{run_dir} holds no checkpoint; train it first (jaxdist train --run-dir {run_dir})"
        )


def load_source(source: str, mesh: str, devices: str, cache: str, step: int | None = None):
    check_source(source)
    mesh_, rules, platform_cfg, _ = setup(Common(mesh=mesh, devices=devices, compile_cache=cache))
    from flax import nnx

    from jaxdist.rules import state_shardings
    from models.transformer import Transformer

    def targets_for(config):
        import jax

        abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0))))
        shardings = state_shardings(abstract, rules, mesh_)
        flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
        by_path = dict(jax.tree_util.tree_flatten_with_path(shardings)[0])
        return {
            path[0].key: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=by_path[path])
            for path, a in flat
        }

    platform = {"compute_dtype": platform_cfg.compute_dtype, "attention": "xla"}
    if source.startswith("hf:"):
        from jaxdist.hf.safetensors_io import SafetensorsDir
        from models.hf import load, open_model

        model = open_model(source)
        config = dataclasses.replace(model.config, **platform)
        params = load(model._replace(config=config), targets_for(config))
        tok = model.path / TOKENIZER
        return Source(
            config,
            params,
            mesh_,
            rules,
            model.vocab_size,
            _eos(model.hf_config, model.path),
            tok if tok.is_file() else None,
            model.hf_config,
            model.path,
            SafetensorsDir(model.path).dtype(),
        )
    run_dir = pathlib.Path(source)
    record = read_record(run_dir)
    from models.presets import from_record

    config = dataclasses.replace(from_record(record["model"]), **platform)
    params = _restore_params(run_dir, record, config, mesh_, rules, step)
    init = record.get("init_from") or {}
    data = record.get("data_source") or {}
    vocab = data.get("vocab_size") or init.get("vocab_size") or config.vocab_size
    hf_dir = pathlib.Path(init["path"]) if init else None
    eos = data.get("eos_id")
    if eos is None and init:
        eos = _eos(init.get("config", {}), hf_dir)
    return Source(
        config,
        params,
        mesh_,
        rules,
        min(vocab, init.get("vocab_size", vocab)),
        eos,
        _run_tokenizer(record, hf_dir),
        init.get("config"),
        hf_dir,
        init.get("dtype", "float32"),
    )


def _run_tokenizer(record: dict, hf_dir: pathlib.Path | None) -> pathlib.Path | None:
    data_path = (record.get("data") or {}).get("path")
    if data_path and (pathlib.Path(data_path) / TOKENIZER).is_file():
        return pathlib.Path(data_path) / TOKENIZER
    if hf_dir is not None and (hf_dir / TOKENIZER).is_file():
        return hf_dir / TOKENIZER
    return None


def _restore_params(run_dir, record, config, mesh, rules, step):
    from jaxdist.checkpoint.store import Checkpointer
    from jaxdist.optim import OptimConfig, make_optimizer
    from jaxdist.rules import batch_sharding, batch_ways
    from jaxdist.step import StepConfig, build
    from models.presets import model_spec

    class OneStep(Checkpointer):
        """Restores `step` only, verified as any restore is."""

        def steps(self) -> list[int]:
            return [s for s in super().steps() if step is None or s == step]

    # The optimizer's structure must match the checkpoint's, though only parameters are used.
    tx, lr = make_optimizer(OptimConfig(**record["optim"]), record["loop"]["steps"])
    rows = batch_ways(batch_sharding(rules, mesh))
    spec = model_spec(config)
    jitted = build(spec.init, tx, lr, rules, mesh, StepConfig(), 0, rows)
    checkpointer = OneStep(run_dir / "checkpoints")
    try:
        if step is not None and step not in checkpointer.steps():
            have = Checkpointer.steps(checkpointer)
            raise ConfigError(
                f"{run_dir} holds no checkpoint of step {step}; it has {have or 'none'}"
            )
        from jaxdist.checkpoint.store import param_shapes

        shapes = param_shapes(jitted.abstract_state.params)
        restored = checkpointer.restore_latest(jitted.abstract_state, shapes)
    finally:
        checkpointer.close()
    if restored is None:
        raise ConfigError(f"{run_dir} holds no valid checkpoint (all were set aside as damaged)")
    import jax

    flat = jax.tree_util.tree_flatten_with_path(restored.state.params)[0]
    return {path[0].key: x for path, x in flat}


# --- train --init-from hf:PATH / --model hf:PATH --------------------------------------------


def init_from(args):
    """`train --init-from hf:PATH`: the model becomes PATH's, its weights checked against its
    config.json before anything starts; returns (args, the model)."""
    from jaxdist.hf.safetensors_io import SafetensorsDir
    from models.hf import check_weights, open_model

    spec = args.init_from
    if not spec.startswith("hf:"):
        raise ConfigError(
            f"--init-from {spec!r}: pass hf:PATH, a local Hugging Face model directory"
        )
    if args.model not in ("tiny", spec):
        raise ConfigError(
            f"--init-from {spec} takes its architecture from {spec}/config.json; drop --model "
            f"{args.model}"
        )
    sizes = {"style", "layers", "d_model", "heads", "kv_heads", "d_mlp", "vocab"}
    given = [f"--{a.replace('_', '-')}" for a in sorted(sizes) if getattr(args, a) is not None]
    if given:
        raise ConfigError(
            f"--init-from {spec}: {', '.join(given)} would change the pretrained model's shape; "
            "drop them (--seq-len may shorten the context)"
        )
    model = open_model(spec)
    check_weights(model, SafetensorsDir(model.path).tensors)
    if args.seq_len and model.config.style == "gpt2" and args.seq_len > model.config.seq_len:
        raise ConfigError(
            f"--seq-len {args.seq_len}: {spec} has learned positions for "
            f"{model.config.seq_len} tokens only"
        )
    if args.seq_len:
        model = model._replace(config=dataclasses.replace(model.config, seq_len=args.seq_len))
    return dataclasses.replace(args, model=spec), model


def hf_vocab(config, spec: str, data: str | None, data_vocab: int, pretrained: bool):
    """An HF architecture keeps its vocabulary; the data must fit in it, and pretrained
    weights need the data tokenized with their own tokenizer."""
    from models.hf import open_model

    hf_model = open_model(spec)
    fix = f"jaxdist tokenize --tokenizer {hf_model.path / TOKENIZER} --out DIR --input FILE"
    if data_vocab > hf_model.vocab_size:
        raise ConfigError(
            f"the data's vocabulary has {data_vocab} tokens, {spec} has {hf_model.vocab_size}; "
            f"tokenize the data with the model's tokenizer: {fix}"
        )
    theirs = hf_model.path / TOKENIZER
    if pretrained and theirs.is_file():
        ours = pathlib.Path(data) / TOKENIZER if data else None
        if ours is None or not ours.is_file() or ours.read_bytes() != theirs.read_bytes():
            raise ConfigError(
                f"--init-from {spec}: the data ({data or 'the embedded corpus, as bytes'}) is not "
                f"tokenized with the model's tokenizer, so its ids mean other text to the "
                f"pretrained weights; prepare it with {fix}"
            )
    return config


def initial_state(model, optim, steps: int):
    """The run's first state: the HF weights, read into the step's parameter layout, and a
    fresh optimizer state (step 0)."""

    def make(jitted):
        import jax
        import jax.numpy as jnp

        from jaxdist.optim import make_optimizer
        from jaxdist.step import TrainState
        from models.hf import load

        tx, _ = make_optimizer(optim, steps)
        abstract = jitted.abstract_state.params
        flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
        params = load(model, {path[0].key: leaf for path, leaf in flat})
        tree = jax.tree_util.tree_map_with_path(lambda p, _: params[p[0].key], abstract)
        fresh = jax.jit(
            lambda p: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p)),
            out_shardings=jitted.state_sharding,
            donate_argnums=0,
        )
        return fresh(tree)

    return make
