"""The rule table is checked at startup: every mistake is a ConfigError naming the culprit."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxdist.errors import ConfigError
from jaxdist.layout import MESH_AXES, AxisRules
from jaxdist.model import LOGICAL_AXES
from jaxdist.rules import check_divisible
from meshes.presets import STANDARD_RULES
from tests.helpers import compiled_for, mesh_for


def _rows_without(name):
    return tuple(r for r in STANDARD_RULES.rows if r[0] != name)


def test_standard_rules_validate():
    STANDARD_RULES.validate(MESH_AXES)


@pytest.mark.parametrize(
    "rows, message",
    [
        (STANDARD_RULES.rows + (("embed", None, None),), "appears twice"),
        (STANDARD_RULES.rows + (("embd", None, None),), "unknown logical axis 'embd'"),
        (_rows_without("mlp"), "no row for logical axes ['mlp']"),
        (_rows_without("mlp") + (("mlp", "tensr", None),), "mesh axis 'tensr'"),
        (_rows_without("mlp") + (("mlp", ("fsdp", "fsdp"), None),), "repeats a mesh axis"),
    ],
)
def test_bad_tables_are_errors(rows, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        AxisRules(rows).validate(MESH_AXES)


def test_spec_resolution_and_axis_used_twice():
    # Weights are stored split over fsdp and context (whose devices hold other tokens of the
    # same rows); activations split the batch over the replica axes and the sequence over context.
    assert STANDARD_RULES.spec(("embed", "mlp"), "param") == P(("fsdp", "context"), "tensor")
    assert STANDARD_RULES.spec(("batch", "seq", "embed"), "activation") == P(
        ("data", "fsdp", "expert"), "context", None
    )
    # A name given twice ([T, T] as seq, seq) splits its first dim only.
    assert STANDARD_RULES.spec(("seq", "seq"), "activation") == P("context", None)
    rows = _rows_without("embed") + (("embed", "tensor", None),)
    with pytest.raises(ConfigError, match="would split both 'embed' and 'mlp'"):
        AxisRules(rows).spec(("embed", "mlp"), "param", "parameter w")


def test_indivisible_dimension_names_parameter_dim_and_axis():
    mesh = mesh_for("data=2,tensor=4")
    with pytest.raises(ConfigError, match=r"parameter w: dimension 'heads' of size 6 .* tensor"):
        check_divisible("parameter w", (6, 8), ("heads", "embed"), P("tensor", None), mesh)


def test_model_with_too_few_heads_for_tensor_axis_fails_before_compiling():
    # tiny has 4 kv heads: tensor=8 cannot split them.
    with pytest.raises(
        ConfigError, match=r"parameter \w+: dimension '(kv_)?heads' of size 4 .*tensor \(size 8\)"
    ):
        compiled_for("tensor=8")


def test_every_logical_axis_has_a_legend_letter():
    import jaxdist.model as axes

    for name in LOGICAL_AXES:
        assert name in axes.__doc__, name
    assert jax.device_count() == 8
