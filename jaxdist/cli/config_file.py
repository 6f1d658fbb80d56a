"""`--config FILE`: a command's whole config tree from YAML, TOML or JSON, flags on top.

The tree is the command's own dataclasses, nested as on the command line: top-level fields
(`model`, `mesh`, `batch_size`, `data`, ...) and one table per component (`loop`, `optim`,
`step`, `checkpoint`, `eval`, `cluster`), each key a field name:

    model: tiny-llama
    mesh: data=2,fsdp=2,tensor=2
    batch_size: 16
    data: data/mine
    loop: {steps: 300, log_every: 10, seed: 0}
    optim: {learning_rate: 0.003, schedule: cosine, weight_decay: 0.1}

A run's `config.json` holds the tree it was started with under `cli`, so it is such a file:
`jaxdist train --config runs/X/config.json` replays the run, as a new run: its run directory
is not taken over (that would resume X, or find it finished), so the replay gets a new one,
runs/<time> like any run started without --run-dir, named in the run's first line and in every
message that says how to resume it. `--run-dir DIR` beside `--config` chooses the directory
(`--run-dir runs/X` resumes X). Unknown keys and values of the wrong type are errors that name
the key, never silently dropped.
"""

import dataclasses
import difflib
import functools
import json
import pathlib
import tomllib
import types
import typing
from typing import Any, Literal

import yaml

from jaxdist.errors import ConfigError


def read(path: str) -> dict:
    """The tree in a config file (a run's config.json: the tree it was started with)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a .yaml, .toml or .json file")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            tree = yaml.safe_load(text)
        elif p.suffix == ".toml":
            tree = tomllib.loads(text)
        elif p.suffix == ".json":
            tree = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: use a .yaml, .yml, .toml or .json name")
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {path} does not parse: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a table of settings at the top")
    if "cli" in tree and "versions" in tree:  # a run's config.json
        if not isinstance(tree["cli"], dict):
            raise ConfigError(f"{path} is a run record without a `cli` tree to replay")
        return _as_new_run(tree["cli"])
    if "versions" in tree:
        raise ConfigError(
            f"{path} is a run record written by a script (jaxdist.fit), not by `jaxdist train`; "
            "replay it with that script"
        )
    return tree


def _as_new_run(tree: dict) -> dict:
    """A recorded run's tree without its run directory: a replay is a new run."""
    loop = tree.get("loop")
    if isinstance(loop, dict) and "run_dir" in loop:
        tree = {**tree, "loop": {k: v for k, v in loop.items() if k != "run_dir"}}
    return tree


def build(cls: type, tree: dict, where: str = "") -> Any:
    """An instance of dataclass `cls` from `tree`, recursively; missing keys keep defaults."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values = {}
    for key, value in tree.items():
        name = key.replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"config key {where}{key!r} is not a setting{hint}; known: {', '.join(fields)}"
            )
        values[name] = _value(hints[name], value, f"{where}{name}.")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config {where or 'file'}: {e}") from None


def _value(kind, value, where: str):
    key = where.rstrip(".")
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a table of {kind.__name__} settings")
        return build(kind, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _value(option, value, where)
            except ConfigError:
                continue
        raise ConfigError(f"config key {key!r}: {value!r} is not a {kind}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"config key {key!r}: {value!r} is not one of {list(args)}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key {key!r} must be a list")
        return tuple(_value(args[0], v, where) for v in value)
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind in (int, str, bool) and type(value) is kind:
        return value
    if kind is typing.Any:
        return value
    raise ConfigError(f"config key {key!r}: {value!r} is not a {getattr(kind, '__name__', kind)}")


def split_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    """`--config FILE` (or `--config=FILE`) taken out of a command line."""
    rest, path = [], None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise ConfigError("--config needs a file: --config run.yaml")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


# A run's record (jaxdist.checkpoint.resume.run_record) holds the model and data as the library
# built them; their flags, where the command's own config tree (`flags_of`) does not name them.
_RECORD_FLAGS = {
    "model.name": "--model",
    "model.style": "--style",
    "model.num_layers": "--layers",
    "model.d_model": "--d-model",
    "model.num_heads": "--heads",
    "model.num_kv_heads": "--kv-heads",
    "model.d_mlp": "--d-mlp",
    "model.vocab_size": "--vocab",
    "model.seq_len": "--seq-len",
    "data.batch_size": "--batch-size",
    "data.seed": "--seed",
    "data.path": "--data",
    "data_source.fingerprint": "--data",
    "data_source.tokenizer": "--data",
    "data_source.sources": "--data",
    "mesh.replica": "--mesh (its replica axis)",
}


class Flag(typing.NamedTuple):
    names: tuple[str, ...]  # the first is the one the help names: --lr, not --learning-rate
    repeated: bool  # given once per value (--fault A --fault B), not all values at once


@functools.cache
def flags_of(kind: type) -> dict[str, Flag]:
    """Each field of command `kind`'s config tree (`loop.run_dir`, `sync.sync_every`) and its
    flag (`--run-dir`), as tyro's parser spells them: the one place a path meets its flag."""
    import warnings

    import tyro

    # tyro.extras.get_parser is deprecated in tyro 1.0 (pinned) without a replacement that
    # returns the parser; the flags are read from argparse's own actions.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = tyro.extras.get_parser(kind)
    return {
        a.dest.replace("-", "_"): Flag(tuple(a.option_strings), type(a).__name__ == "_AppendAction")
        for a in parser._actions
        if a.option_strings and a.dest != "help"
    }


def flag_of(path: str, kind: type) -> str:
    """The flag that sets config field `path` (of command `kind`'s tree, or of a run's record),
    or the path itself where no flag sets it (a preset's own constant, rope_theta)."""
    if path in _RECORD_FLAGS:
        return _RECORD_FLAGS[path]
    flag = flags_of(kind).get(path)
    return flag.names[0] if flag else path


def command_line(args, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that make command config `args` again, each field that differs from the
    command's default (`--config`, when given, is spelled out: its values are among them);
    the fields in `skip` left out, for the caller to give."""
    flags = flags_of(type(args))
    given = _leaves(dataclasses.asdict(args))
    default = _leaves(dataclasses.asdict(type(args)()))
    out = []
    for path, value in given.items():
        if path in skip or path == "config" or value == default.get(path):
            continue
        names, repeated = flags[path]
        if isinstance(value, bool):
            out.append(names[0] if value else next(n for n in names if n.startswith("--no-")))
        elif isinstance(value, list | tuple) and repeated:
            out += [part for v in value for part in (names[0], str(v))]
        elif isinstance(value, list | tuple):
            out += [names[0], *(str(v) for v in value)]
        else:
            out += [names[0], str(value)]
    return out


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _leaves(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out
