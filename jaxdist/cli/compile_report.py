"""`jaxdist train --compile-only`: the step compiled ahead of time (for a target this host does
not have, or its own devices), its memory beside the one price's prediction and the device, its
collectives per mesh axis; exit 1 when the program does not fit the target."""

import contextlib
import dataclasses
import json
import sys

from rich.console import Console
from rich.table import Table

from jaxdist.compiled import aot, gemms
from jaxdist.compiled.memory import device_memory, remat_said, target_hardware, xla_said
from jaxdist.planning import fit
from models.remat import ORDER


def compile_only(args, model_cfg, mesh, layout, vocab: tuple[int, int | None]) -> int:
    """Compiles the step and reports it; with --remat auto and a --target, a policy the
    compiler refuses (or whose peak does not fit the device) gives way to the next one
    (jaxdist.compiled.aot.compile_fitting)."""
    platform = mesh.devices.flat[0].platform
    # Fake CPU devices hold nothing of a compile: only a target's or an accelerator's memory.
    memory = device_memory(mesh, args.target) if args.target or platform != "cpu" else None
    auto = args.remat == "auto" and args.target is not None

    def compile_at(policy: str) -> dict:
        cfg = dataclasses.replace(model_cfg, remat=policy)
        at = dataclasses.replace(layout, remat=policy)
        with xla_said() as (said, live), compiling(Console(file=live), args, mesh, at):
            report = _report(args, cfg, mesh, at, vocab, memory)
        remat = remat_said(said)
        return report | ({"xla_remat": remat} if remat else {})

    report, tried = aot.compile_fitting(model_cfg.remat, ORDER if auto else (), compile_at)
    report["remat"] = {"policy": tried[-1], "tried": tried} if auto else model_cfg.remat
    return finish(report, args.json)


def compiling(console: Console, args, mesh, layout):
    """Says on stderr what is compiled, for what, and that it takes a while (XLA may work for a
    minute in silence); on a terminal, a spinner until it is done."""
    where = args.target or f"{mesh.devices.size} {mesh.devices.flat[0].platform} devices"
    what = (
        f"compiling {args.model}'s train step for {where} (mesh {_mesh(dict(mesh.shape))}, "
        f"batch {layout.batch_size} x {layout.seq_len}, remat {layout.remat or 'none'})"
    )
    console.print(f"{what}; XLA may take a minute", markup=False, highlight=False, soft_wrap=True)
    if not console.is_terminal or console.quiet:
        return contextlib.nullcontext()
    return console.status(f"XLA is compiling {args.model} for {where}", spinner="dots")


def finish(report: dict, json_path: str | None) -> int:
    """The report as JSON (`json_path` "-": on stdout, else to that file) or the short table,
    then the verdict: 0 where the program fits (or the device's memory is unknown), 1 not."""
    if json_path == "-":
        print(json.dumps(report))
    else:
        if json_path:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=1)
        print_report(report, Console(width=100))
    if report.get("fits", True):
        return 0
    print(
        f"jaxdist: the step {_verdict(report).line()}; use a smaller "
        "--batch-size, --remat full (or auto), more --microbatches, or a mesh that shards more",
        file=sys.stderr,
    )
    return 1


def _report(args, model_cfg, mesh, layout, vocab, memory) -> dict:
    from jaxdist.kernels.loss import Vocab
    from jaxdist.optim import make_optimizer
    from jaxdist.planning.memory import device_peak
    from jaxdist.step import build
    from models.inventory import plan_model
    from models.presets import model_spec

    # No data read: the batch is abstract (and a target's hosts are not this one).
    model = model_spec(model_cfg)
    tx, lr = make_optimizer(args.optim, args.loop.steps)
    jitted = build(model.init, tx, lr, layout, mesh, args.loop.seed, Vocab(*vocab))
    report = aot.compile_only(jitted)
    predicted = device_peak(plan_model(model_cfg), layout, report["platform"])["peak"]
    report |= aot.memory_fit(report, memory, predicted)
    if args.target:
        report |= aot.target_report(target_hardware(args.target), report, model, layout)
    report |= {"model": model.name, "params": jitted.num_params, "mesh": dict(mesh.shape)}
    report |= {"batch_size": layout.batch_size, "seq_len": layout.seq_len}
    return report | {"loss_vocab": vocab[0]}  # the ids the loss may predict


def print_report(report: dict, console: Console) -> None:
    """The short table: memory per device (compiled, predicted, the device's) with the GEMMs
    by the types they read, and the collectives per mesh axis."""
    gib = 2**30
    mem = report["per_device_bytes"]
    title = (
        f"{report['model']} on {report['device_kind']} x {_devices(report)}, mesh "
        f"{_mesh(report['mesh'])}, batch {report['batch_size']} x {report['seq_len']}, remat "
        f"{report['remat']['policy'] if isinstance(report['remat'], dict) else report['remat']}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("memory per device", justify="left")
    table.add_column("GiB", justify="right")
    table.add_row(
        "compiled peak (XLA: arguments + outputs + temporaries)",
        f"{mem['peak_estimate'] / gib:.2f}",
    )
    table.add_row(
        "predicted (the plan's memory model)", f"{report['predicted_peak_bytes'] / gib:.2f}"
    )
    verdict = _verdict(report)
    if verdict is not None:
        table.add_row("a program may hold on the device", f"{verdict.budget / gib:.2f}")
        table.add_row("verdict", "fits" if verdict.fits else "DOES NOT FIT")
    if "gemms" in report:  # what the step's GEMMs read, beside its memory
        table.caption, table.caption_justify = gemms.summary(report["gemms"]), "left"
    console.print(table)
    if verdict is not None:  # the rule, its margin stated: the plan's own (planning.fit)
        console.print(verdict.line(), highlight=False)
    if "xla_remat" in report:
        console.print(_remat_line(report["xla_remat"], mem["peak_estimate"]), highlight=False)
    comm = Table(title="collectives per step", title_justify="left")
    for col in ("axis", "kind", "count", "GB"):
        comm.add_column(col, justify="left" if col in ("axis", "kind") else "right")
    for c in report["collectives"]:
        comm.add_row(c["axis"], c["kind"], str(c["count"]), f"{c['bytes'] / 1e9:.3f}")
    console.print(comm)
    # Findings about the compiled program (an fp32 matmul, attention left unfused) are part of
    # the report, on stdout with it and in --json's "warnings"; the run's own go to stderr.
    for w in report.get("warnings", []):
        console.print(f"warning: {w}", markup=False, highlight=False)


def _remat_line(remat: dict, peak: float) -> str:
    """XLA's "only reduced to" beside the table's compiled peak: what each counts."""
    return (
        f'XLA\'s rematerialization said "only reduced to {remat["reached_bytes"] / 2**30:.2f}GiB" '
        f"(its limit {remat['limit_bytes'] / 2**30:.2f}): its own count of the program before "
        f"fusion and buffer assignment; the compiled peak, {peak / 2**30:.2f} GiB, is the "
        "buffers the finished program allocates, the figure the verdict reads"
    )


def _verdict(report: dict):
    """The compiled peak by the plan's rule (jaxdist.planning.fit.verdict), where the device's
    memory is known."""
    if "device_memory_bytes" not in report:
        return None
    peak = report["per_device_bytes"]["peak_estimate"]
    return fit.verdict(peak, report["device_memory_bytes"], report["platform"], predicted=False)


def _devices(report: dict) -> int:
    n = 1
    for size in report["mesh"].values():
        n *= size
    return n


def _mesh(shape: dict) -> str:
    return ",".join(f"{a}={n}" for a, n in shape.items() if n > 1) or "single"
