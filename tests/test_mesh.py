"""Mesh layouts: parsing, presets, and a mesh always uses every device it is given."""

import jax
import pytest

from jaxdist.errors import ConfigError
from jaxdist.layout import MESH_AXES
from jaxdist.mesh import build_mesh, parse_mesh
from meshes.presets import PRESETS, get_mesh_preset


def test_parse_and_build_inline_layout():
    mesh = build_mesh(parse_mesh("data=2,fsdp=2,tensor=2"))
    assert dict(mesh.shape) == {
        "replica": 1,
        "pipeline": 1,
        "data": 2,
        "fsdp": 2,
        "context": 1,
        "expert": 1,
        "tensor": 2,
    }
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_fill_axis():
    mesh = build_mesh(parse_mesh("data=2,fsdp=-1"))
    assert dict(mesh.shape) == {
        "replica": 1,
        "pipeline": 1,
        "data": 2,
        "fsdp": 4,
        "context": 1,
        "expert": 1,
        "tensor": 1,
    }


@pytest.mark.parametrize(
    "text, message",
    [
        ("dta=2", "unknown mesh axis 'dta'"),
        ("data", "is not axis=size"),
        ("data=x", "not an integer"),
        ("data=0", "positive size"),
        ("data=2,data=4", "given twice"),
        ("data=-1,fsdp=-1", "at most one"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_mesh(text)


def test_device_count_mismatch_is_an_error_not_a_subset():
    with pytest.raises(ConfigError, match="needs 4 devices but 8 are present"):
        build_mesh(parse_mesh("data=4"))
    with pytest.raises(ConfigError, match="needs 1 devices but 8 are present"):
        build_mesh(get_mesh_preset("single").mesh)


def test_presets():
    assert dict(build_mesh(PRESETS["cpu8"].mesh).shape) == {
        "replica": 1,
        "pipeline": 1,
        "data": 2,
        "fsdp": 2,
        "context": 1,
        "expert": 1,
        "tensor": 2,
    }
    assert build_mesh(PRESETS["single"].mesh, jax.devices()[:1]).size == 1
    assert PRESETS["gpu2x8"].mesh.num_devices == 16
    assert dict(PRESETS["gpu2x8"].mesh.dcn) == {"data": 2}
    assert PRESETS["v5p-128"].mesh.num_devices == 64  # Google Cloud counts 2 cores a chip
    for preset in PRESETS.values():
        preset.rules.validate(MESH_AXES)
    with pytest.raises(ConfigError, match="needs 16 devices"):
        build_mesh(PRESETS["gpu2x8"].mesh)
    with pytest.raises(ConfigError, match="unknown mesh 'cpu9'"):
        get_mesh_preset("cpu9")
