"""The pipeline moves each stage's weights once per step (jaxdist.parallel.stage_weights):
`jaxdist comm` finds every collective of pipelined layouts where the per-step model puts it,
and against the same model without a pipeline on half the devices, the data, FSDP and tensor
bytes fall (a stage holds half the layers)."""

import json

import pytest

from tests.helpers import cli

SLOW = pytest.mark.slow
# A scalar reduction (loss, norms) shows as an unexpected row of a few bytes; nothing else may.
SCALARS = 1024


def _comm(layout: str, devices: int, *flags: str) -> dict:
    r = cli(
        "comm",
        "--model",
        "tiny",
        "--layers",
        "8",
        "--mesh",
        layout,
        "--devices",
        f"cpu:{devices}",
        "--microbatches",
        "4",
        "--json",
        *flags,
    )
    assert r.returncode == 0, r.stderr
    return {(row["axis"], row["kind"]): row for row in json.loads(r.stdout)["rows"]}


@pytest.mark.parametrize(
    "layout, flags",
    [
        pytest.param("pipeline=2,fsdp=4", (), marks=SLOW),
        ("pipeline=2,data=2,tensor=2", ()),
        pytest.param(
            "pipeline=4,data=2",
            ("--pipeline-schedule", "interleaved", "--virtual-stages", "2"),
            marks=SLOW,
        ),
        pytest.param("pipeline=2,fsdp=2,tensor=2", (), marks=SLOW),
    ],
)
def test_every_collective_is_where_the_per_step_model_puts_it(layout, flags):
    rows = _comm(layout, 8, *flags)
    for (axis, kind), row in rows.items():
        if row["expected_bytes"]:
            assert row["ratio"] == pytest.approx(1.0, abs=0.05), (axis, kind, row)
        else:
            assert row["bytes"] < SCALARS, (axis, kind, row)
    # Once per step: one gather per weight array, not one per tick or layer.
    gathers = [r for (a, k), r in rows.items() if k == "all-gather"]
    assert all(r["count"] <= 16 for r in gathers), gathers


def _moved(rows: dict, axes: set[str]) -> float:
    """Bytes on collectives spanning any of `axes`, the pipeline's own permutes left out."""
    return sum(
        r["bytes"]
        for (label, kind), r in rows.items()
        if set(label.split("+")) & axes and kind != "collective-permute"
    )


@pytest.mark.parametrize(
    "pipelined, flat",
    [
        ("pipeline=2,fsdp=4", "fsdp=4"),
        pytest.param("pipeline=2,data=2,tensor=2", "data=2,tensor=2", marks=SLOW),
    ],
)
def test_a_stage_moves_fewer_bytes_than_the_whole_model_unpipelined(pipelined, flat):
    # Anchored outside the per-step model: the compiled programs of both layouts.
    axes = {"data", "fsdp", "tensor"}
    ratio = _moved(_comm(pipelined, 8), axes) / _moved(_comm(flat, 4), axes)
    assert ratio <= 0.75, ratio
