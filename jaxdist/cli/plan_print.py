"""What `jaxdist plan` prints: the ranked layouts in 80 columns (every term with --wide), the
compiler's word beside them (--verify), and the `jaxdist train` command that runs the choice."""

import dataclasses
import shlex

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from jaxdist.compiled.aot import BYTES_TOLERANCE, MEMORY_TOLERANCE
from jaxdist.layout import StepConfig, SyncConfig
from jaxdist.planning import fit, quality

# Common's model-size flags (jaxdist.cli.options), as the command line spells them.
_SIZE_FLAGS = ("style", "layers", "d_model", "heads", "kv_heads", "d_mlp", "vocab")


def train_command(args, row: dict) -> str:
    """`jaxdist train` with every setting the plan assumed for this layout: the model and its
    sizes, the mesh, the batch and sequence, the step's settings (microbatches always, the
    rest where not train's defaults), the dtype, kernel and MoE settings given, the remat
    policy."""
    argv = ["jaxdist", "train", "--model", args.model]
    for attr in _SIZE_FLAGS:
        if getattr(args, attr) is not None:
            argv += [_flag(attr), str(getattr(args, attr))]
    argv += ["--mesh", row["layout"], "--batch-size", str(args.batch_size)]
    argv += ["--seq-len", str(row["seq_len"]), "--microbatches", str(row["microbatches"])]
    default = StepConfig()
    for field in dataclasses.fields(StepConfig):
        name, value = field.name, getattr(args.step, field.name)
        if name in ("microbatches", "fault_nan_steps") or value == getattr(default, name):
            continue
        if isinstance(value, bool):
            argv.append(_flag(name) if value else _flag("no_" + name))
        else:
            argv += [_flag(name), str(value)]
    for attr in ("compute_dtype", "attention"):
        if getattr(args, attr) != "auto":
            argv += [_flag(attr), getattr(args, attr)]
    if args.capacity_factor is not None:
        argv += ["--capacity-factor", str(args.capacity_factor)]
    if args.moe_buffer_factor is not None:
        argv += ["--moe-buffer-factor", str(args.moe_buffer_factor)]
    argv += ["--remat", row["remat"]] + _sync_flags(row)
    return shlex.join(argv)


# Always written for a layout of replica groups (what the plan priced), the rest where not
# train's defaults.
_SYNC_ALWAYS = ("sync_every", "sync_dtype", "sync_fragments", "sync_delay")


def _sync_flags(row: dict) -> list[str]:
    """The sync settings a layout of replica groups was priced at, as train's flags."""
    if "sync" not in row:
        return []
    default = SyncConfig()
    argv = []
    for name, value in row["sync"].items():
        if name in _SYNC_ALWAYS or value != getattr(default, name):
            argv += [_flag(name), str(value)]
    return argv


def check_target(result: dict, hw) -> str | None:
    """The --target that compiles the plan's choice from this host (a TPU slice, or H100/H200
    hosts), or None for hardware without one."""
    devices = result["devices"]
    if hw.slice_name and devices == hw.devices_per_host:
        return hw.slice_name
    if hw.platform == "gpu" and hw.name in ("h100", "h200"):
        per_host = min(devices, hw.devices_per_host)
        hosts = devices // per_host
        return f"{hw.name}:{hosts}x{per_host}" if hosts > 1 else f"{hw.name}:{per_host}"
    return None


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def _ms(s: float) -> str:
    """Milliseconds in three significant digits (whole ones from 100)."""
    ms = s * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def _heading(result: dict, console: Console) -> None:
    if result.get("slice"):
        chips = result["devices_per_host"]
        slices = result["devices"] // chips
        across = f"; {slices} slices joined by DCN" if slices > 1 else ""
        console.print(f"{result['slice']}: {chips} chips{across}")
    if result.get("machine"):
        per_host = result["devices_per_host"]
        hosts = -(-result["devices"] // per_host)
        console.print(
            f"{result['machine']}: {per_host} {result['hardware'].upper()} per host, {hosts} "
            f"hosts, {result['between_hosts_bytes_s'] / 1e9:g} GB/s per GPU between them"
        )
    if result.get("slow_link"):
        console.print(
            f"slow link: {result['slow_link']}, "
            f"{result['between_hosts_bytes_s'] * 8 / 1e9:g} Gbit/s per device (--link-gbps)",
            highlight=False,
        )
    console.print(
        f"{result['model']} on {result['devices']} x {result['hardware']}, batch "
        f"{result['batch_size']} rows of {result['seq_len']:,} tokens (--seq-len): "
        f"the {len(result['layouts'])} fastest of {result['considered']} layouts, predicted",
        highlight=False,
    )
    # The rule every "fits" of the plan applies, its margin stated (jaxdist.planning.fit).
    console.print(
        f"memory: a predicted peak fits in {result['fit_rule']}",
        highlight=False,
        soft_wrap=True,
    )


def print_plan(result: dict, console: Console, wide: bool = False) -> None:
    """The ranked layouts, soonest to data parallelism's loss first, and the naive data=N beside
    them: per device, the remat policy, microbatches, GiB, then the fleet law's terms in ms
    (compute over N, the pipeline's bubble where any, exposed communication, the straggler's
    sync, the step), with replica groups the tokens factor and the time to data parallelism's
    loss, and MFU. Without --wide, within 80 columns for layouts of up to 23 characters."""
    _heading(result, console)
    rows = [(r["layout"], r) for r in result["layouts"]]
    naive = result.get("naive")
    if naive and all(r["layout"] != naive["layout"] for _, r in rows):
        rows.append((f"{naive['layout']} (naive)", naive))
    bubbles = wide or any(r["bubble_s"] for _, r in rows)
    outer = any("sync" in r for _, r in rows)
    fp8 = any("fp8" in r for _, r in rows)
    # One space between columns and none at the edges: 80 columns hold the default table.
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0))
    for col in _columns(wide, bubbles, outer, fp8):
        text = col in ("layout", "remat")
        # Nothing is cut: a layout too long for its column folds onto a second line.
        table.add_column(col, justify="left" if text else "right", overflow="fold")
    for name, r in rows:
        table.add_row(*_cells(name, r, wide, bubbles, outer, fp8))
    _print_whole(table, console)
    notes = ["mb: microbatches", "ms per step"]
    if not wide:
        notes.append("comm*: what compute does not hide (--wide: each apart)")
    if outer:
        notes += [_outer_note(rows, wide), _quality_note()]
    if fp8:
        notes.append(_fp8_note(rows))
    if not all(r["fits"] for _, r in rows):
        notes.append("GiB!: over the usable memory")
    console.print("; ".join(notes), highlight=False)
    _footer(result, rows, naive, console)
    _grouped_line(result, console)
    _link_line(rows, console)


def _print_whole(table: Table, console: Console) -> None:
    """The table at its own width where the output is a file or a pipe (a script reads whole
    names and figures, never one folded onto two lines); a terminal's width folds it."""
    need = Measurement.get(console, console.options.update_width(10_000), table).maximum
    if console.is_terminal or need <= console.width:
        console.print(table)
        return
    width, console.width = console.width, need
    try:
        console.print(table)
    finally:
        console.width = width


def _columns(wide: bool, bubbles: bool, outer: bool, fp8: bool) -> list[str]:
    columns = ["layout", "remat", "mb", "GiB", "comp"] + (["bubl"] if bubbles else [])
    columns += ["comm", "-ovl"] + (["outer"] if outer else []) if wide else ["comm*"]
    columns += ["sync", "step"] + (["xtok", "to DP"] if outer else []) + ["MFU"]
    return columns + (["tok/s"] if wide else []) + (["vs bf16"] if fp8 else [])


def _cells(name: str, r: dict, wide: bool, bubbles: bool, outer: bool, fp8: bool) -> list[str]:
    """One row's cells, in _columns' order."""
    cells = [name, r["remat"], str(r["microbatches"])]
    cells += [f"{r['memory_bytes']['peak'] / fit.GIB:.3g}" + ("" if r["fits"] else "!")]
    cells += [_ms(r["compute_s"])] + ([_ms(r["bubble_s"])] if bubbles else [])
    if wide:
        cells += [_ms(r["comm_s"]), _ms(r["overlap_s"])]
        cells += [_ms(r["outer_exposed_s"]) if "sync" in r else "-"] if outer else []
    else:
        cells += [_ms(r["comm_s"] - r["overlap_s"] + r.get("outer_exposed_s", 0.0))]
    cells += [_ms(r["sync_s"]), _ms(r["step_s"])]
    if outer:
        cells += [f"{r['tokens_factor']:.3f}", _ms(r["to_loss_s"])]
    cells += [f"{r['mfu']:.0%}"] + ([f"{r['tokens_per_s']:,.0f}"] if wide else [])
    return cells + ([f"{r['fp8']['speedup']:.2f}x"] if fp8 else [])


def _outer_note(rows, wide: bool) -> str:
    """What the outer exchange is, at the sync settings of the replica layouts shown."""
    s = next(r["sync"] for _, r in rows if "sync" in r)
    T = s["sync_delay"]
    hidden = f", less what the next {T} step(s) of compute hide" if T else ""
    return (
        f"{'outer' if wide else 'comm* includes'} replica groups' exchange ({s['sync_dtype']}, "
        f"{s['sync_fragments']} fragment(s)) over the slow link every {s['sync_every']} steps, "
        f"per step{hidden}"
    )


def _quality_note() -> str:
    """What the tokens factor is, and at which H the paper measured it."""
    return (
        "xtok: tokens to data parallelism's loss per token of it (replica groups: "
        f"arXiv:2503.09799's loss for M groups at H = {quality.PAPER_H}, whatever --sync-every; "
        "Chinchilla's law in tokens); to DP: step x xtok, the ranking"
    )


def _fp8_note(rows) -> str:
    """What the FP8 column is, and how many projections run in FP8."""
    f = rows[0][1]["fp8"]
    return (
        f"vs bf16: the same layout's predicted speedup with {f['projections']} of {f['of']} "
        "projection kinds in FP8 (forward and both backward GEMMs; the casts priced), the "
        "head and attention in the compute dtype"
    )


def _grouped_line(result: dict, console: Console) -> None:
    """Where replica groups were asked for and none is among the layouts shown: where the
    best one ranks, and why (its step and the tokens its groups cost, against the first's)."""
    g = result.get("best_grouped")
    shown = len(result["layouts"])
    if g is None or (g["rank"] is not None and g["rank"] <= shown):
        return
    if g["rank"] is None:
        why = "too big for device memory" if g["priced"] else "none splits evenly"
        console.print(f"no layout of replica groups fits: {why}", highlight=False, soft_wrap=True)
        return
    r, first = g["row"], g["first"]
    pace = "faster" if r["step_s"] < first["step_s"] else "slower"
    console.print(
        f"best layout of replica groups, ranked {g['rank']} of {g['of']} that fit: "
        f"{r['layout']} ({r['remat']}, {r['microbatches']} mb): a {pace} step than "
        f"{first['layout']}'s ({_ms(r['step_s'])} ms against {_ms(first['step_s'])}), but its "
        f"groups need {r['tokens_factor']:.3f}x the tokens to data parallelism's loss (xtok): "
        f"{_ms(r['to_loss_s'])} ms of step per step's worth of progress against "
        f"{_ms(first['to_loss_s'])}",
        highlight=False,
        soft_wrap=True,
    )


def _link_line(rows, console: Console) -> None:
    """The slow link each of the top layouts needs for 80% compute utilization."""
    needs = [(name, r["link_gbps_80"]) for name, r in rows if "link_gbps_80" in r]
    if not needs:
        return

    def shown(gbps) -> str:
        return "none reaches it" if gbps is None else "any" if gbps == 0 else f"{gbps:.3g}"

    parts = "; ".join(f"{name} {shown(g)}" for name, g in needs)
    console.print(
        f"slow link for 80% compute utilization, Gbit/s per device: {parts}", highlight=False
    )


def _footer(result: dict, rows, naive, console: Console) -> None:
    if result["rejected"]:
        why = ", ".join(f"{k}: {n}" for k, n in result["rejected"].items())
        console.print(f"rejected before pricing: {why}", highlight=False)
    if result["too_big"]:
        console.print(f"{result['too_big']} layouts priced but too big for device memory")
    best = result["layouts"][0]
    if naive and not naive["fits"]:
        console.print(
            f"naive data parallel ({naive['layout']}) does not fit: "
            f"{fit.gib(naive['memory_bytes']['peak'], 1)} per device; best: {best['layout']}"
        )
    elif naive and naive is not best:
        grouped = best["tokens_factor"] != 1
        per = "to data parallelism's loss" if grouped else "per step"
        console.print(
            f"best {best['layout']} vs naive data parallel {naive['layout']}: "
            f"{naive['to_loss_s'] / best['to_loss_s']:.2f}x faster {per} (predicted)"
        )


def print_command(result: dict, console: Console, target: str | None) -> None:
    """The command that runs the plan's choice, and how to compile it for the target here."""
    if result["command"] is None:
        console.print(
            "no verified layout fits once compiled: none is recommended; try --verify with "
            "more layouts, --remat full, or a smaller --batch-size",
            style="bold red",
        )
        return
    choice = result["layouts"][result["best"]]
    verified = " (fits once compiled)" if "verify" in choice else ""
    console.print(f"run the first choice, {choice['layout']}{verified}:", highlight=False)
    console.print(f"  {result['command']}", markup=False, highlight=False, soft_wrap=True)
    if target:
        console.print(
            f"check it from this host: add --compile-only --target {target}",
            markup=False,
            highlight=False,
        )


def print_verify(result: dict, console: Console, platform: str) -> None:
    rows = [r for r in result["layouts"] if "verify" in r]
    table = Table(
        title="verify: predicted vs compiled (XLA memory analysis, HLO collectives)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for col in ("layout", "remat", "GiB pred", "GiB XLA", "ratio", "fits", "MB pred", "MB HLO"):
        table.add_column(col, justify="left" if col in ("layout", "remat") else "right")
    table.add_column("ratio", justify="right")
    for r in rows:
        v = r["verify"]
        table.add_row(
            r["layout"],
            r["remat"],
            f"{v['predicted_peak_bytes'] / fit.GIB:.2f}",
            f"{v['xla_peak_bytes'] / fit.GIB:.2f}",
            f"{v['memory_ratio']:.3f}" + ("" if v["memory_ok"] else " FLAG"),
            "yes" if v["fits"] else "NO",
            f"{v['predicted_collective_bytes'] / 1e6:.1f}",
            f"{v['hlo_collective_bytes'] / 1e6:.1f}",
            f"{v['bytes_ratio']:.3f}" + ("" if v["bytes_ok"] else " FLAG"),
        )
    _print_whole(table, console)
    compiled = fit.verdict(0.0, result["memory_per_device"], platform, predicted=False)
    console.print(
        f"fits: XLA's peak within {compiled.rule()}; the plan's prediction kept "
        f"{1 - fit.PREDICTION_MARGIN:.0%} back for its error",
        highlight=False,
        soft_wrap=True,
    )
    for r in rows:
        if "refused" in r["verify"]:
            console.print(f"{r['layout']}: XLA refused to compile it: {r['verify']['refused']}")
    flagged = [
        r["layout"] for r in rows if not (r["verify"]["memory_ok"] and r["verify"]["bytes_ok"])
    ]
    if flagged:
        console.print(
            f"[bold red]disagreement beyond {MEMORY_TOLERANCE:.0%} (memory) or "
            f"{BYTES_TOLERANCE:.0%} (collective bytes) on: {', '.join(flagged)}[/]"
        )
    else:
        console.print(
            f"every verified layout within {MEMORY_TOLERANCE:.0%} (memory) and "
            f"{BYTES_TOLERANCE:.0%} (collective bytes)"
        )
