"""Where a model comes from, for generation and export: a run's checkpoint restored onto a mesh
(any mesh: it is resharded), or a local Hugging Face directory (`hf:PATH`) read straight into
one; with the vocabulary, EOS and tokenizer that go with it.

`check` finds everything a user can get wrong before any device starts; `load` then puts the
checked source on a mesh. What is model-specific comes from an HFAdapter (jaxdist/hf/adapter.py)
and the model's ModelSpec. `hf_dir` alone decides which model names are Hugging Face directories.
"""

import json
import pathlib
from typing import Any, NamedTuple

from jaxdist.errors import ConfigError
from jaxdist.hf.adapter import HFAdapter, OpenedModel
from jaxdist.model import ModelSpec

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


class Checked(NamedTuple):
    """A source found usable, nothing loaded yet."""

    source: str  # RUN_DIR or hf:PATH
    adapter: HFAdapter
    spec: ModelSpec
    model: OpenedModel | None  # hf:PATH, opened, its weights checked
    record: dict | None  # RUN_DIR's config.json


def read_record(run_dir: pathlib.Path) -> dict:
    try:
        return json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{run_dir}/config.json is missing or unreadable ({e}); pass a run directory made by "
            "jaxdist train, or hf:PATH for a Hugging Face model directory"
        ) from None


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
    run_dir = pathlib.Path(source)
    record = read_record(run_dir)
    steps = [p for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]
    if not steps:
        raise ConfigError(
            f"{run_dir} holds no checkpoint; train it first (jaxdist train --run-dir {run_dir})"
        )
    return Checked(source, adapter, adapter.from_record(record.get("model", {})), None, record)


def load(checked: Checked, mesh, rules, compute_dtype: str, step: int | None = None) -> Source:
    """The checked source's parameters on `mesh` as `rules` lay them out; a run's checkpoint of
    `step` (default: the newest good one); generation computes in `compute_dtype`."""
    adapter, spec, model = checked.adapter, checked.spec, checked.model
    if model is not None:
        from jaxdist.hf.safetensors_io import SafetensorsDir

        params = adapter.from_hf(model, _targets(spec, mesh, rules))
        tok = model.path / TOKENIZER
        stops = eos_ids(model.hf_config, model.path)
        return Source(
            spec,
            params,
            mesh,
            rules,
            compute_dtype,
            model.vocab_size,
            stops[0] if stops else None,
            tok if tok.is_file() else None,
            model.hf_config,
            model.path,
            SafetensorsDir(model.path).dtype(),
            adapter,
            stops,
        )
    run_dir, record = pathlib.Path(checked.source), checked.record
    params = _restore_params(run_dir, record, spec, mesh, rules, step)
    init = record.get("init_from") or {}
    data = record.get("data_source") or {}
    vocab = data.get("vocab_size") or init.get("vocab_size") or spec.vocab_size
    init_dir = pathlib.Path(init["path"]) if init else None
    # The data's document separator, and whatever ends the source model's generation.
    stops = (data["eos_id"],) if data.get("eos_id") is not None else ()
    if init:
        stops = tuple(dict.fromkeys(stops + eos_ids(init.get("config", {}), init_dir)))
    eos = stops[0] if stops else None
    return Source(
        spec,
        params,
        mesh,
        rules,
        compute_dtype,
        min(vocab, init.get("vocab_size", vocab)),
        eos,
        _run_tokenizer(record, init_dir),
        init.get("config"),
        init_dir,
        init.get("dtype", "float32"),
        adapter,
        stops,
    )


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


def _restore_params(run_dir, record, spec, mesh, rules, step) -> dict:
    import jax

    from jaxdist.checkpoint.store import Checkpointer, param_shapes
    from jaxdist.config import OptimConfig
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.optim import make_optimizer
    from jaxdist.parallel import replica
    from jaxdist.rules import batch_sharding, batch_ways
    from jaxdist.step import build

    class OneStep(Checkpointer):
        """Restores `step` only, verified as any restore is."""

        def steps(self) -> list[int]:
            return [s for s in super().steps() if step is None or s == step]

    # The optimizer's structure must match the checkpoint's, though only parameters are used.
    tx, lr = make_optimizer(OptimConfig(**record["optim"]), record["loop"]["steps"])
    rows = batch_ways(batch_sharding(rules, mesh))
    # Replica groups: the checkpoint holds each group's weights and the outer ones, which are
    # the model's.
    sync = replica.recorded(record, mesh.shape, run_dir)
    groups = mesh.shape.get("replica", 1) if sync else 1
    # --fp8 delayed: the state holds its FP8 state too.
    step_cfg = StepConfig(**StepConfig.recorded_state(record.get("step") or {}))
    layout = Layout.on(mesh, rules, step_cfg, batch_size=rows * groups, sync=sync)
    jitted = build(spec.init, tx, lr, layout, mesh)
    checkpointer = OneStep(run_dir / "checkpoints")
    try:
        if step is not None and step not in checkpointer.steps():
            have = Checkpointer.steps(checkpointer)
            raise ConfigError(
                f"{run_dir} holds no checkpoint of step {step}; it has {have or 'none'}"
            )
        shapes = param_shapes(jitted.abstract_state.params)
        restored = checkpointer.restore_latest(jitted.abstract_state, shapes)
    finally:
        checkpointer.close()
    if restored is None:
        raise ConfigError(f"{run_dir} holds no valid checkpoint (all were set aside as damaged)")
    state = restored.state
    weights = state.params if state.outer is None else state.outer.params
    flat = jax.tree_util.tree_flatten_with_path(weights)[0]
    return {path[0].key: x for path, x in flat}
