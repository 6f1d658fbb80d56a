"""Where a model comes from, for generation and export: a run's checkpoint opened on a mesh
(jaxdist.inference.runs: any mesh, it is resharded), or a local Hugging Face directory
(`hf:PATH`) read straight into one; with the vocabulary, EOS and tokenizer that go with it.

`check` finds everything a user can get wrong before any device starts; `load` then puts the
checked source on a mesh. What is model-specific comes from an HFAdapter (jaxdist/hf/adapter.py)
and the model's ModelSpec. `hf_dir` alone decides which model names are Hugging Face directories.
"""

from __future__ import annotations

import json
import pathlib
from typing import TYPE_CHECKING, Any, NamedTuple

from jaxdist.errors import ConfigError
from jaxdist.hf.adapter import HFAdapter, OpenedModel
from jaxdist.model import ModelSpec

# `hf_dir` is read by the flags and the model presets, which load no jax; opening a run does.
if TYPE_CHECKING:
    from jaxdist.inference import runs

TOKENIZER = "tokenizer.json"
_HF = "hf:"


def hf_dir(name: str) -> pathlib.Path | None:
    """PATH of a model named hf:PATH, a local Hugging Face model directory; None for any other
    name (a preset, custom, a run directory)."""
    return pathlib.Path(name.removeprefix(_HF)) if name.startswith(_HF) else None


class Source(NamedTuple):
    """A model ready to use: its spec, parameters on the mesh, and its vocabulary."""

    spec: ModelSpec
    params: dict  # name -> global jax array
    mesh: Any
    rules: Any
    compute_dtype: str  # what generation computes in on this platform
    vocab_size: int  # the real vocabulary (ids past it are padding)
    eos_id: int | None  # the EOS (a run's documents' separator; export's config.json)
    tokenizer: pathlib.Path | None  # tokenizer.json; None: UTF-8 bytes
    hf_config: dict | None  # the Hugging Face config the model came from
    source_dir: pathlib.Path | None  # the Hugging Face directory it came from
    dtype: str  # the source weights' dtype
    adapter: HFAdapter
    eos_ids: tuple[int, ...] = ()  # the other ids that end generation (a model's EOS list)

    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos_id, and eos_ids."""
        first = () if self.eos_id is None else (self.eos_id,)
        return tuple(dict.fromkeys(first + self.eos_ids))

    @classmethod
    def from_hf(cls, model: OpenedModel, adapter: HFAdapter, mesh, rules, compute_dtype: str):
        """A Hugging Face directory's model, read straight onto `mesh`."""
        from jaxdist.hf.safetensors_io import SafetensorsDir

        tok = model.path / TOKENIZER
        stops = eos_ids(model.hf_config, model.path)
        return cls(
            spec=model.spec,
            params=adapter.from_hf(model, _targets(model.spec, mesh, rules)),
            mesh=mesh,
            rules=rules,
            compute_dtype=compute_dtype,
            vocab_size=model.vocab_size,
            eos_id=stops[0] if stops else None,
            tokenizer=tok if tok.is_file() else None,
            hf_config=model.hf_config,
            source_dir=model.path,
            dtype=SafetensorsDir(model.path).dtype(),
            adapter=adapter,
            eos_ids=stops,
        )

    @classmethod
    def from_run(cls, run: runs.OpenRun, adapter: HFAdapter, compute_dtype: str):
        """A run's checkpoint opened on a mesh (jaxdist.inference.runs), with the vocabulary,
        EOS and tokenizer of its data, else of the model it started from (--init-from)."""
        record = run.record
        init = record.get("init_from") or {}
        data = record.get("data_source") or {}
        vocab = data.get("vocab_size") or init.get("vocab_size") or run.spec.vocab_size
        init_dir = pathlib.Path(init["path"]) if init else None
        # The data's document separator, and whatever ends the source model's generation.
        stops = (data["eos_id"],) if data.get("eos_id") is not None else ()
        if init:
            stops = tuple(dict.fromkeys(stops + eos_ids(init.get("config", {}), init_dir)))
        return cls(
            spec=run.spec,
            params=run.by_name(),
            mesh=run.mesh,
            rules=run.rules,
            compute_dtype=compute_dtype,
            vocab_size=min(vocab, init.get("vocab_size", vocab)),
            eos_id=stops[0] if stops else None,
            tokenizer=_run_tokenizer(record, init_dir),
            hf_config=init.get("config"),
            source_dir=init_dir,
            dtype=init.get("dtype", "float32"),
            adapter=adapter,
            eos_ids=stops,
        )


class Checked(NamedTuple):
    """A source found usable, nothing loaded yet."""

    source: str  # RUN_DIR or hf:PATH
    adapter: HFAdapter
    spec: ModelSpec
    model: OpenedModel | None  # hf:PATH, opened, its weights checked
    record: dict | None  # RUN_DIR's config.json


def eos_ids(hf: dict, directory: pathlib.Path | None) -> tuple[int, ...]:
    """Every id that ends generation, as transformers' generate reads them: generation_config.json's
    eos_token_id (an id or a list: any of them stops it), else config.json's; else the EOS
    declared for the tokenizer beside them (tokenizer_config.json), else one found by name."""
    gen = {}
    if directory is not None and (directory / "generation_config.json").is_file():
        try:
            gen = json.loads((directory / "generation_config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{directory}/generation_config.json is unreadable ({e})") from None
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    if eos is None and directory is not None and (directory / TOKENIZER).is_file():
        from jaxdist.data.tokenizer import load

        try:
            eos = load(directory / TOKENIZER).eos_id
        except ConfigError:  # none declared nor named: generation runs to its length
            eos = None
    eos = eos if isinstance(eos, list) else [eos]
    return tuple(dict.fromkeys(int(i) for i in eos if i is not None))


def eos_id(hf: dict, directory: pathlib.Path | None) -> int | None:
    """The first of eos_ids: the one EOS a config.json written for the model names."""
    return next(iter(eos_ids(hf, directory)), None)


def check(source: str, adapter: HFAdapter) -> Checked:
    """What can be wrong with the source, found before any device starts."""
    path = hf_dir(source)
    if path is not None:
        model = adapter.open(path)
        model.check_weights()
        return Checked(source, adapter, model.spec, model, None)
    from jaxdist.inference import runs

    run_dir = pathlib.Path(source)
    record = runs.read_record(run_dir, ", or hf:PATH for a Hugging Face model directory")
    steps = [p for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]
    if not steps:
        raise ConfigError(
            f"{run_dir} holds no checkpoint; train it first (jaxdist train --run-dir {run_dir})"
        )
    return Checked(source, adapter, adapter.from_record(record.get("model", {})), None, record)


def load(checked: Checked, mesh, rules, compute_dtype: str, step: int | None = None) -> Source:
    """The checked source's parameters on `mesh` as `rules` lay them out; a run's checkpoint of
    `step` (default: the newest good one); generation computes in `compute_dtype`."""
    if checked.model is not None:
        return Source.from_hf(checked.model, checked.adapter, mesh, rules, compute_dtype)
    from jaxdist.inference import runs

    run = runs.open_run(pathlib.Path(checked.source), checked.spec, mesh, rules, step)
    return Source.from_run(run, checked.adapter, compute_dtype)


def _targets(spec: ModelSpec, mesh, rules) -> dict:
    """name -> ShapeDtypeStruct with the sharding `rules` give the parameter on `mesh`."""
    import jax
    from flax import nnx

    from jaxdist.rules import state_shardings

    abstract = nnx.state(nnx.eval_shape(lambda: spec.init(nnx.Rngs(0))))
    shardings = state_shardings(abstract, rules, mesh)
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    by_path = dict(jax.tree_util.tree_flatten_with_path(shardings)[0])
    return {
        path[0].key: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=by_path[path])
        for path, a in flat
    }


def _run_tokenizer(record: dict, init_dir: pathlib.Path | None) -> pathlib.Path | None:
    data_path = (record.get("data") or {}).get("path")
    if data_path and (pathlib.Path(data_path) / TOKENIZER).is_file():
        return pathlib.Path(data_path) / TOKENIZER
    if init_dir is not None and (init_dir / TOKENIZER).is_file():
        return init_dir / TOKENIZER
    return None
