"""The communication report (`jaxdist comm`): the collectives XLA compiled into the step, beside
what the layout implies (jaxdist.planning.traffic), per mesh axis and kind; with replica
groups, the outer step's program too, beside what planning.sync prices it at."""

import re
from collections import Counter

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
    found = hlo.collectives(text, dict(mesh.shape), share)
    measured = hlo.summarize(found)
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
        "rows": _explained(_rows(measured, exp), _sources(text, found)),
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
    found = [c for c in hlo.collectives(text, dict(mesh.shape)) if c.axes == (REPLICA,)]
    exp = {(REPLICA, k): b for k, b in sync.exchange_bytes(model.abstract_params, layout).items()}
    return _explained(_rows(hlo.summarize(found), exp), _sources(text, found))


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


# The op JAX named an instruction after (`jit(step)/vmap(transpose(jvp()))/scatter-add`).
_OP_NAME = re.compile(r'op_name="([^"]+)"')
# Why a collective the layout's model does not price is there, by the op that made it, where
# the cause is known.
_CAUSES = {
    "scatter-add": (
        "the embedding table's gradient, a scatter-add XLA partitions itself (where "
        "jaxdist.kernels.lookup leaves the table's sum to XLA: inside replica groups, or no "
        "token axis splits the table)"
    ),
}
# Measured and expected bytes this close are one exchange compiled as another kind.
SAME_BYTES = 0.05


def _sources(text: str, found: list) -> dict[tuple[str, str], Counter]:
    """(axis label, kind) -> the ops that made its collectives: (op, in the backward pass)."""
    op_of = {}
    for ins in hlo.instructions(text):
        m = _OP_NAME.search(ins.line)
        if m and hlo.opcode(ins.op) in hlo.COLLECTIVES:
            op_of[hlo.base_name(ins.name)] = m.group(1)
    out: dict[tuple[str, str], Counter] = {}
    for c in found:
        name = op_of.get(hlo.base_name(c.name), "")
        key = ("+".join(c.axes) or "none", c.kind)
        out.setdefault(key, Counter())[(name.rsplit("/", 1)[-1], "transpose(" in name)] += 1
    return out


def _explained(rows: list[dict], sources: dict[tuple[str, str], Counter]) -> list[dict]:
    """Each collective the model does not expect, said in words (`note`). One the model
    expects as another kind, on the same axis and of the same bytes, that the program never
    runs, is that one compiled otherwise: the two rows become one, beside its expectation."""
    for r in [r for r in rows if r["bytes"] and not r["expected_bytes"]]:
        twin = next(
            (
                m
                for m in rows
                if m["axis"] == r["axis"]
                and not m["count"]
                and m["expected_bytes"]
                and abs(r["bytes"] / m["expected_bytes"] - 1) <= SAME_BYTES
            ),
            None,
        )
        made = _made_by(sources.get((r["axis"], r["kind"]), Counter()))
        if twin is None:
            r["note"] = f"not in the layout's model: {made}"
            continue
        rows.remove(twin)
        r["expected_bytes"] = twin["expected_bytes"]
        r["ratio"] = r["bytes"] / twin["expected_bytes"]
        r["expected_kind"] = twin["kind"]
        r["note"] = f"the {twin['kind']} the model expects, compiled as {r['kind']}: {made}"
    for r in rows:
        if r["expected_bytes"] and not r["count"]:
            others = [m["kind"] for m in rows if m["axis"] == r["axis"] and "note" in m]
            also = f" (on {r['axis']} it runs {', '.join(others)} the model does not expect)"
            r["note"] = "the model expects it; the program runs none" + (also if others else "")
    return rows


def _made_by(ops: Counter) -> str:
    """The ops that made a row's collectives, in words."""
    said = []
    for (op, backward), n in ops.most_common():
        cause = (
            _CAUSES.get(op)
            or f"`{op or 'unnamed'}` in the {'backward' if backward else 'forward'} pass"
        )
        said.append(cause + (f" (x{n})" if n > 1 else ""))
    return "; ".join(said) or "no op named in the program"


def mesh_label(shape: dict[str, int]) -> str:
    """`replica=2,fsdp=4`: the axes of more than one device, as --mesh takes them."""
    return ",".join(f"{a}={n}" for a, n in shape.items() if n > 1) or "single"


def print_table(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    _table(f"collectives per step on mesh {mesh_label(report['mesh'])}", report["rows"], console)
    if "outer_rows" in report:
        title = "outer step, every H steps (all fragments)"
        _table(title, report["outer_rows"], console)


def _table(title: str, rows: list[dict], console: Console) -> None:
    table = Table(title=title)
    for col in ("axis", "kind", "count", "MB", "expected MB", "ratio"):
        text = col in ("axis", "kind")  # names whole
        table.add_column(col, justify="left" if text else "right", no_wrap=text)
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "unexpected"
        table.add_row(
            r["axis"],
            r["kind"] + ("*" if "note" in r else ""),
            str(r["count"]),
            f"{r['bytes'] / 1e6:.3f}",
            f"{r['expected_bytes'] / 1e6:.3f}",
            ratio,
        )
    console.print(table)
    for r in rows:
        if "note" in r:
            console.print(
                f"* {r['axis']} {r['kind']}: {r['note']}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
