"""The slow link DiLoCo needs (experiments/diloco_bandwidth.py), by the planner's alpha-beta
pricing under the paper's idealized setting, within 15% of Charles et al.'s Table 6
(arXiv:2503.09799)."""

import pytest

from jaxdist.errors import ConfigError
from tests.helpers import load_experiment

diloco_bandwidth = load_experiment("diloco_bandwidth")


@pytest.mark.parametrize(
    "row", diloco_bandwidth.rows(), ids=lambda r: f"{r['model']} {r['method']}"
)
def test_table_6_of_the_diloco_scaling_laws_within_15_percent(row):
    assert row["ours"] == pytest.approx(row["paper"], rel=0.15)


def test_a_setting_without_a_bandwidth_says_which():
    with pytest.raises(ConfigError, match="H at least 1"):
        diloco_bandwidth.paper_bandwidth(10e9, 0.8, 0)
