"""`train --init-from hf:PATH`, its flags checked: the model and its shape are PATH's (only
--seq-len may shorten its context), and PATH opened, its weights checked, before anything
starts. The library (jaxdist/hf/) takes the opened model from here; the transformer's adapter
(models/hf_adapter.py) reads it."""

import dataclasses

from jaxdist.errors import ConfigError
from jaxdist.hf.source import check, hf_dir
from models.hf_adapter import ADAPTER

# The train flags that set the model's shape, which a pretrained model already has.
_SHAPE_FLAGS = ("d_mlp", "d_model", "heads", "kv_heads", "layers", "style", "vocab")


def init_from(args):
    """`args`: the train command's flags (init_from, model, the shape flags, seq_len); returns
    (args with --model hf:PATH, the opened model)."""
    spec = args.init_from
    if hf_dir(spec) is None:
        raise ConfigError(
            f"--init-from {spec!r}: pass hf:PATH, a local Hugging Face model directory"
        )
    if args.model not in ("tiny", spec):  # tiny: --model's default, not given
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
    model = check(spec, ADAPTER).model
    if args.seq_len:
        try:
            model = model.with_seq_len(args.seq_len)
        except ConfigError as e:
            raise ConfigError(f"--seq-len {args.seq_len}: {e}") from None
    return dataclasses.replace(args, model=spec), model
