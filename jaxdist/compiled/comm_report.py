"""The communication report (`jaxdist comm`): the collectives XLA compiled into the step, beside
what the layout implies (jaxdist.planning.traffic), per mesh axis and kind; with replica
groups, the outer step's program too, beside what planning.sync prices it at."""

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

from jaxdist.compiled import hlo
from jaxdist.layout import REPLICA, Layout
from jaxdist.parallel import pipeline, rounds, schedules
from jaxdist.planning import sync
from jaxdist.planning.inputs import PlanModel
from jaxdist.planning.traffic import layout_bytes


def report(jitted, model: PlanModel, layout: Layout, optimizer: str = "adamw") -> dict:
    """Compiles the step for abstract inputs and puts measured beside expected bytes (a
    pipeline's tick branches counted on their own ticks only); `optimizer`: the step's."""
    mesh = jitted.batch_sharding.mesh
    shape = (layout.batch_size, layout.seq_len + 1)
    text = jitted.compile_abstract(shape).as_text()
    share = pipeline.branch_share(schedules.for_layout(layout)) if layout.stages > 1 else None
    measured = hlo.summarize(hlo.collectives(text, dict(mesh.shape), share))
    platform = mesh.devices.flat[0].platform
    # Replica groups: each group's step (the outer step is compiled apart, below).
    inner = layout.group_alone() if layout.grouped else layout
    exp = layout_bytes(model, inner, platform, optimizer=optimizer)
    out = {
        "mesh": dict(mesh.shape),
        "batch_size": layout.batch_size,
        "seq_len": layout.seq_len,
        "microbatches": layout.microbatches,
        "optimizer": optimizer,
        "rows": _rows(measured, exp),
    }
    if layout.grouped:
        out["outer_rows"] = _outer_rows(jitted, model, layout)
    return out


def _outer_rows(jitted, model: PlanModel, layout: Layout) -> list[dict]:
    """The outer step's collectives, every fragment's at once, compiled beside what
    planning.sync prices them at (over `replica`; the rest is the inner step's again)."""
    F = layout.sync.sync_fragments
    act = rounds.Action(tuple(range(F)), tuple(range(F)), after=True)
    mesh = jitted.batch_sharding.mesh
    batch = jax.ShapeDtypeStruct(
        (layout.batch_size, layout.seq_len + 1), jnp.int32, sharding=jitted.batch_sharding
    )
    text = jitted.step_fn.lower(jitted.abstract_state, batch, act).compile().as_text()
    measured = hlo.summarize(hlo.collectives(text, dict(mesh.shape)))
    measured = {k: v for k, v in measured.items() if k[0] == REPLICA}
    exp = {(REPLICA, k): b for k, b in sync.exchange_bytes(model.abstract_params, layout).items()}
    return _rows(measured, exp)


def _rows(measured: dict, exp: dict) -> list[dict]:
    rows = []
    for axis, kind in sorted(set(measured) | set(exp)):
        m = measured.get((axis, kind), {"count": 0, "bytes": 0})
        e = exp.get((axis, kind), 0.0)
        rows.append(
            {
                "axis": axis,
                "kind": kind,
                "count": m["count"],
                "bytes": m["bytes"],
                "expected_bytes": e,
                "ratio": (m["bytes"] / e) if e else None,
            }
        )
    return rows


def print_table(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    _table(f"collectives per step on mesh {report['mesh']}", report["rows"], console)
    if "outer_rows" in report:
        title = "the replica groups' outer step, every fragment at once (every H steps)"
        _table(title, report["outer_rows"], console)


def _table(title: str, rows: list[dict], console: Console) -> None:
    table = Table(title=title)
    for col in ("axis", "kind", "count", "MB", "expected MB", "ratio"):
        table.add_column(col, justify="left" if col in ("axis", "kind") else "right")
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "unexpected"
        table.add_row(
            r["axis"],
            r["kind"],
            str(r["count"]),
            f"{r['bytes'] / 1e6:.3f}",
            f"{r['expected_bytes'] / 1e6:.3f}",
            ratio,
        )
    console.print(table)
