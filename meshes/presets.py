"""Named meshes for CPU tests and real targets, and the rule table each one uses."""

import dataclasses

from jaxdist.errors import ConfigError
from jaxdist.mesh import MeshConfig, parse_mesh
from jaxdist.rules import AxisRules

# One row per logical axis: (logical, mesh axes for parameters, mesh axes for activations).
# Batch splits over every replica axis; FSDP shards weights' `embed` dim (ZeRO-3: gathered per
# layer, gradients reduce-scattered); tensor parallelism splits heads, MLP width and vocab the
# Megatron way, so each layer needs one all-reduce forward and one backward per sublayer.
# `heads` is listed for completeness: attention weights are split by kv group (`kv_heads`).
# Experts split over `expert`, whose devices also share the batch outside the expert layers
# (expert parallelism inside data parallelism); tokens travel to their experts by all-to-all.
STANDARD_RULES = AxisRules(
    rows=(
        ("batch", None, ("data", "fsdp", "expert")),
        ("seq", None, None),
        ("embed", "fsdp", None),
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


PRESETS: dict[str, MeshPreset] = {
    p.name: p
    for p in [
        MeshPreset("single", MeshConfig(ici=()), STANDARD_RULES, "one device, nothing sharded"),
        MeshPreset(
            "cpu8",
            MeshConfig(ici=(("data", 2), ("fsdp", 2), ("tensor", 2))),
            STANDARD_RULES,
            "8 fake CPU devices, every strategy at once (the test and default layout)",
        ),
        MeshPreset(
            "gpu8",
            MeshConfig(ici=(("fsdp", 8),)),
            STANDARD_RULES,
            "one host of 8 GPUs over NVLink: FSDP across all eight",
        ),
        MeshPreset(
            "gpu8-tp",
            MeshConfig(ici=(("fsdp", 4), ("tensor", 2))),
            STANDARD_RULES,
            "one host of 8 GPUs: FSDP 4 x tensor 2 (tensor pairs on the fastest links)",
        ),
        MeshPreset(
            "gpu2x8",
            MeshConfig(ici=(("fsdp", 8),), dcn=(("data", 2),)),
            STANDARD_RULES,
            "2 hosts x 8 GPUs: data parallel across hosts (DCN), FSDP inside (NVLink)",
        ),
        MeshPreset(
            "tpu-v5p-8",
            MeshConfig(ici=(("fsdp", 8),)),
            STANDARD_RULES,
            "a TPU v5p slice of 8 chips (2x2x2): FSDP over the ICI torus",
        ),
        MeshPreset(
            "tpu-v5p-64",
            MeshConfig(ici=(("fsdp", 16), ("tensor", 4))),
            STANDARD_RULES,
            "a TPU v5p slice of 64 chips (4x4x4): FSDP 16 x tensor 4",
        ),
    ]
}


def get_mesh_preset(text: str) -> MeshPreset:
    """A preset by name, or an inline `axis=size,...` layout with the standard rules."""
    if text in PRESETS:
        return PRESETS[text]
    if "=" in text:
        return MeshPreset(text, parse_mesh(text), STANDARD_RULES, "inline layout")
    raise ConfigError(
        f"unknown mesh {text!r}; use a preset ({', '.join(PRESETS)}) or axis=size pairs "
        "such as data=2,fsdp=2,tensor=2"
    )
