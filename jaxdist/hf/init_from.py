"""`jaxdist train --init-from hf:PATH` (a local Hugging Face model's weights, a fresh optimizer,
step 0) and `--model hf:PATH` (its architecture, randomly initialized): the checks before
anything starts, and the run's first state. What is model-specific comes from a ModelFamily
(jaxdist/hf/family.py)."""

import dataclasses
import pathlib

from jaxdist.errors import ConfigError
from jaxdist.hf.family import ModelFamily, OpenedModel
from jaxdist.hf.source import TOKENIZER

# The train flags that set the model's shape, which a pretrained model already has.
_SHAPE_FLAGS = ("d_mlp", "d_model", "heads", "kv_heads", "layers", "style", "vocab")


def init_from(family: ModelFamily, args):
    """`train --init-from hf:PATH`: the model becomes PATH's, its weights checked against its
    config.json before anything starts. `args`: the train command's flags (init_from, model,
    the shape flags, seq_len); returns (args with --model hf:PATH, the opened model)."""
    from jaxdist.hf.safetensors_io import SafetensorsDir

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
    given = [f"--{a.replace('_', '-')}" for a in _SHAPE_FLAGS if getattr(args, a) is not None]
    if given:
        raise ConfigError(
            f"--init-from {spec}: {', '.join(given)} would change the pretrained model's shape; "
            "drop them (--seq-len may shorten the context)"
        )
    model = family.open(spec)
    family.check_weights(model, SafetensorsDir(model.path).tensors)
    learned = family.learned_positions(model.config)
    if args.seq_len and learned is not None and args.seq_len > learned:
        raise ConfigError(
            f"--seq-len {args.seq_len}: {spec} has learned positions for {learned} tokens only"
        )
    if args.seq_len:
        model = family.with_seq_len(model, args.seq_len)
    return dataclasses.replace(args, model=spec), model


def hf_vocab(
    family: ModelFamily, spec: str, data: str | None, data_vocab: int, pretrained: bool
) -> None:
    """An HF architecture keeps its vocabulary: refuses data that does not fit in it, and data
    for pretrained weights not tokenized with their own tokenizer."""
    hf_model = family.open(spec)
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


def initial_state(family: ModelFamily, model: OpenedModel, optim, steps: int):
    """The run's first state, for jaxdist.train's `init_state`: the HF weights, read into the
    step's parameter layout, and a fresh optimizer state (step 0)."""

    def make(jitted):
        import jax
        import jax.numpy as jnp

        from jaxdist.optim import make_optimizer
        from jaxdist.step import TrainState

        tx, _ = make_optimizer(optim, steps)
        abstract = jitted.abstract_state.params
        flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
        params = family.load(model, {path[0].key: leaf for path, leaf in flat})
        tree = jax.tree_util.tree_map_with_path(lambda p, _: params[p[0].key], abstract)
        fresh = jax.jit(
            lambda p: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p)),
            out_shardings=jitted.state_sharding,
            donate_argnums=0,
        )
        return fresh(tree)

    return make
