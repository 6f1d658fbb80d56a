"""Named meshes for CPU tests and real targets (presets.toml), and the rule table each uses."""

import dataclasses
import pathlib
import tomllib

from jaxdist.errors import ConfigError
from jaxdist.layout import AxisRules
from jaxdist.mesh import MeshConfig, parse_mesh

# One row per logical axis: (logical, mesh axes for parameters, mesh axes for activations).
# Batch splits over every replica axis; FSDP shards weights' `embed` dim (ZeRO-3: gathered per
# layer, gradients reduce-scattered); tensor parallelism splits heads, MLP width and vocab the
# Megatron way, so each layer needs one all-reduce forward and one backward per sublayer.
# `heads` is listed for completeness: attention weights are split by kv group (`kv_heads`).
# Context parallelism splits the sequence over `context`; its devices need every weight, as
# data-parallel replicas do, so weights are stored split over it as over `fsdp` (torchtitan's
# dp_shard x cp). Experts split over `expert`, whose devices also share the batch outside the
# expert layers (expert parallelism inside data parallelism); tokens travel to their experts by
# all-to-all.
STANDARD_RULES = AxisRules(
    rows=(
        ("batch", None, ("data", "fsdp", "expert")),
        ("seq", None, "context"),
        ("embed", ("fsdp", "context"), None),
        ("mlp", "tensor", "tensor"),
        ("heads", "tensor", "tensor"),
        ("kv_heads", "tensor", "tensor"),
        ("qkv", None, None),
        ("head_dim", None, None),
        ("vocab", "tensor", "tensor"),
        ("layers", "pipeline", None),
        ("expert", "expert", "expert"),
    )
)


@dataclasses.dataclass(frozen=True)
class MeshPreset:
    name: str
    mesh: MeshConfig
    rules: AxisRules
    about: str


def _layout(text: str) -> tuple[tuple[str, int], ...]:
    return parse_mesh(text).ici if text else ()


def _load() -> dict[str, MeshPreset]:
    with pathlib.Path(__file__).with_name("presets.toml").open("rb") as f:
        table = tomllib.load(f)
    return {
        name: MeshPreset(
            name,
            MeshConfig(ici=_layout(row["ici"]), dcn=_layout(row.get("dcn", ""))),
            STANDARD_RULES,
            row["about"],
        )
        for name, row in table.items()
    }


PRESETS: dict[str, MeshPreset] = _load()
# Earlier names that counted chips where Google Cloud counts v5p TensorCores.
RENAMED = {"tpu-v5p-8": "v5p-16", "tpu-v5p-64": "v5p-128"}


def get_mesh_preset(text: str) -> MeshPreset:
    """A preset by name, or an inline `axis=size,...` layout with the standard rules."""
    if text in PRESETS:
        return PRESETS[text]
    if text in RENAMED:
        raise ConfigError(
            f"mesh preset {text!r} is now {RENAMED[text]!r} (Google Cloud's name for that "
            f"slice, which counts 2 TensorCores per v5p chip): use --mesh {RENAMED[text]}"
        )
    if "=" in text:
        return MeshPreset(text, parse_mesh(text), STANDARD_RULES, "inline layout")
    raise ConfigError(
        f"unknown mesh {text!r}; use a preset ({', '.join(PRESETS)}) or axis=size pairs "
        "such as data=2,fsdp=2,tensor=2"
    )
