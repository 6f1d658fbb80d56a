"""The pipeline moves each stage's weights once per step (jaxdist.parallel.stage_weights):
`jaxdist comm` finds every collective of pipelined layouts where the per-step model puts it,
and against the same model without a pipeline on half the devices, the data, FSDP and tensor
bytes fall (a stage holds half the layers)."""

import contextlib
import functools
import io
import json

import jax
import pytest

from jaxdist.cli.main import main
from jaxdist.compiled import hlo
from jaxdist.config import OptimConfig
from jaxdist.layout import Layout, StepConfig
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.optim import make_optimizer
from jaxdist.step import build
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from models.transformer import Transformer

SLOW = pytest.mark.slow
# A scalar reduction (loss, norms) shows as an unexpected row of a few bytes; nothing else may.
SCALARS = 1024
LAYERS, MICROBATCHES, BATCH = 8, 4, 16


@functools.cache
def _comm(layout: str, *flags: str) -> dict:
    """`jaxdist comm --json` on the test process's 8 CPU devices, run once per layout for the
    module (the two tests read the same pipelined layouts): rows keyed (axis, kind)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(
            [
                "comm",
                *("--model", "tiny", "--layers", str(LAYERS), "--mesh", layout),
                *("--devices", "cpu:8", "--compile-cache", "off"),
                *("--microbatches", str(MICROBATCHES), "--json", *flags),
            ]
        )
    assert rc == 0, out.getvalue()[-3000:]
    rows = json.loads(out.getvalue().strip().splitlines()[-1])["rows"]
    return {(row["axis"], row["kind"]): row for row in rows}


def _flat(layout: str) -> dict:
    """The compiled collectives of the same model and step as `_comm` builds them (float32 and
    XLA's attention on CPU, AdamW), unpipelined on 4 of the devices: `jaxdist comm` cannot take
    fewer devices than the test process started with."""
    mesh = build_mesh(parse_mesh(layout), jax.devices()[:4])
    mc = get_model_config("tiny", num_layers=LAYERS, compute_dtype="float32", attention="xla")
    tx, lr = make_optimizer(OptimConfig(), 100)
    step = StepConfig(MICROBATCHES)
    layout = Layout.on(mesh, STANDARD_RULES, step, batch_size=BATCH, seq_len=mc.seq_len)
    c = build(lambda r: Transformer(mc, r), tx, lr, layout, mesh)
    text = c.compile_abstract((BATCH, mc.seq_len + 1)).as_text()
    return hlo.summarize(hlo.collectives(text, dict(mesh.shape)))


# A stage's weights gathered over FSDP; its partial sums over tensor beside a data all-reduce;
# the interleaved schedule. (pipeline=2,fsdp=2,tensor=2 took the same lines of
# traffic._stage_weight and the partial sums as the first two together.)
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
    ],
)
def test_every_collective_is_where_the_per_step_model_puts_it(layout, flags):
    rows = _comm(layout, *flags)
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


@SLOW
@pytest.mark.parametrize(
    "pipelined, flat",
    [
        ("pipeline=2,fsdp=4", "fsdp=4"),
        ("pipeline=2,data=2,tensor=2", "data=2,tensor=2"),
    ],
)
def test_a_stage_moves_fewer_bytes_than_the_whole_model_unpipelined(pipelined, flat):
    # Anchored outside the per-step model: the compiled programs of both layouts.
    axes = {"data", "fsdp", "tensor"}
    ratio = _moved(_comm(pipelined), axes) / _moved(_flat(flat), axes)
    assert ratio <= 0.75, ratio
