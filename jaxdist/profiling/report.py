"""`jaxdist profile`: a trace's breakdown beside the cost model, as a table, JSON and a PNG."""

import dataclasses
import json
import pathlib

from rich.console import Console
from rich.table import Table

from jaxdist.compiled import hlo
from jaxdist.hardware import Hardware, get_hardware
from jaxdist.planning import costmodel
from jaxdist.profiling.breakdown import breakdown
from jaxdist.profiling.xplane import find_xplane, load

NO_PROJECTION = (
    "no projection: the gradient bytes come from the compiled HLO and the mesh (hlo.txt and "
    "mesh.json beside the trace, as a run's profile/ has them, or --hlo and --mesh)"
)


def locate(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The trace to read and the folder its `hlo.txt` and `mesh.json` lie in (or would).

    A run directory means the trace of its `--profile` window, RUN_DIR/profile. jax.profiler
    writes a trace to LOGDIR/plugins/profile/<time>/<host>.xplane.pb and the trainer puts
    hlo.txt and mesh.json in LOGDIR, so a log directory, a trace's own folder and the trace
    file itself all lead to the same three files.
    """
    p = pathlib.Path(path)
    if p.is_dir() and not (p / "hlo.txt").exists() and (p / "profile").is_dir():
        p = p / "profile"
    trace = find_xplane(p)
    here = trace.parent
    if not (here / "hlo.txt").exists() and here.parent.name == "profile":
        if here.parent.parent.name == "plugins":
            here = here.parents[2]
    return trace, here


# Beside a trace, what the trainer knew when it took it: the programs of steps that ran another
# one (replica groups' outer step: step -> file) and the hardware it was attributed against.
PROGRAMS = "programs.json"


@dataclasses.dataclass(frozen=True)
class Saved:
    """A trace and what was saved beside it (see `locate`): the compiled HLO of the traced
    program, the mesh, the programs of steps that ran another one, and the hardware."""

    trace: pathlib.Path
    hlo_text: str | None
    mesh: dict[str, int] | None
    step_hlo: dict[int, str]
    hardware: str | None


def save(
    here: pathlib.Path,
    hlo_text: str,
    mesh_shape: dict[str, int],
    hardware: str,
    step_hlo: dict[int, str] | None = None,
) -> None:
    """What `beside` reads, written by the trainer next to its trace (so that `jaxdist
    profile` of the folder attributes the trace exactly as the run did). Programs shared by
    several steps are written once."""
    (here / "hlo.txt").write_text(hlo_text)
    (here / "mesh.json").write_text(json.dumps(mesh_shape))
    files: dict[str, str] = {}
    steps = {}
    for step, text in sorted((step_hlo or {}).items()):
        if text not in files:
            files[text] = f"hlo_step_{step}.txt"
            (here / files[text]).write_text(text)
        steps[str(step)] = files[text]
    (here / PROGRAMS).write_text(json.dumps({"hardware": hardware, "steps": steps}))


def beside(path: str | pathlib.Path) -> Saved:
    """The trace of `path` (see `locate`) with what the trainer saved beside it (`save`)."""
    trace, here = locate(path)
    hlo_text = (here / "hlo.txt").read_text() if (here / "hlo.txt").exists() else None
    mesh = here / "mesh.json"
    saved = json.loads((here / PROGRAMS).read_text()) if (here / PROGRAMS).exists() else {}
    step_hlo = {int(s): (here / f).read_text() for s, f in saved.get("steps", {}).items()}
    return Saved(
        trace,
        hlo_text,
        json.loads(mesh.read_text()) if mesh.exists() else None,
        step_hlo,
        saved.get("hardware"),
    )


def profile_saved(
    path: str | pathlib.Path,
    hardware: str | None = None,
    hlo_text: str | None = None,
    mesh_shape: dict[str, int] | None = None,
) -> dict:
    """The report of the trace at `path` from what was saved beside it: the one function both
    the trainer's report and `jaxdist profile` call, so both print the same rows. `hardware`,
    `hlo_text`, `mesh_shape`: stand-ins for what is missing (or overrides)."""
    saved = beside(path)
    return profile(
        saved.trace,
        hlo_text or saved.hlo_text,
        mesh_shape or saved.mesh,
        hardware or saved.hardware or "cpu",
        saved.step_hlo if hlo_text is None else None,  # another program: not its steps'
    )


def profile(
    path: str | pathlib.Path,
    hlo_text: str | None = None,
    mesh_shape: dict[str, int] | None = None,
    hardware: str = "cpu",
    step_hlo: dict[int, str] | None = None,
) -> dict:
    """Loads a trace and attributes it; with the compiled HLO and mesh, also per mesh axis,
    and the fleet-law projection (which needs the gradient bytes only the HLO holds).
    `step_hlo`: the program of steps that ran another one (replica groups' outer step)."""
    hw = get_hardware(hardware)
    trace = load(path)
    axes_of, bytes_of = _named(trace, hlo_text, mesh_shape)
    per_step = {s: _named(trace, text, mesh_shape) for s, text in (step_hlo or {}).items()}
    report = breakdown(trace, axes_of, bytes_of, per_step)
    report["hardware"] = hw.name
    report["mesh"] = mesh_shape
    report["model"] = _model(report, mesh_shape or {}, hw, bool(hlo_text and mesh_shape))
    return report


def _named(trace, hlo_text: str | None, mesh_shape) -> tuple[dict[str, str], dict[str, int]]:
    """Each collective's mesh axes and bytes per execution, by its name in the program and in
    the trace (which may suffix it)."""
    axes_of: dict[str, str] = {}
    bytes_of: dict[str, int] = {}
    if hlo_text and mesh_shape:
        for c in hlo.collectives(hlo_text, mesh_shape):
            axes_of[hlo.base_name(c.name)] = "+".join(c.axes) or "none"
            bytes_of[hlo.base_name(c.name)] = c.bytes
        for e in list(trace.events):
            if e.kind == "collective" and hlo.base_name(e.name) != e.name:
                axes_of.setdefault(e.name, axes_of.get(hlo.base_name(e.name), "unknown"))
                bytes_of.setdefault(e.name, bytes_of.get(hlo.base_name(e.name), 0))
    return axes_of, bytes_of


def _model(report: dict, mesh_shape: dict[str, int], hw: Hardware, known: bool) -> dict:
    """Alpha-beta predictions beside the measured per-axis times, and the N-device projection.

    `known`: the compiled HLO and the mesh were given. Without them no collective has bytes,
    and a projection from zero gradient bytes would promise perfect scaling: there is none.
    """
    s = report["summary"]
    per_axis = []
    grad_bytes = 0.0
    for key, v in s["per_axis_per_step"].items():
        axis, kind = key.split("/")
        row = _axis_row(report["steps"], mesh_shape, hw, axis, kind, v)
        if row is None:
            continue
        per_axis.append(row)
        if kind in ("all-reduce", "reduce-scatter") and any(
            a in ("data", "fsdp") for a in axis.split("+")
        ):
            grad_bytes += v["bytes"]
    if not known:
        return {
            "per_axis": per_axis,
            "gradient_bytes_per_step": None,
            "projection": [],
            "projection_missing": NO_PROJECTION,
            "comm_dominates_at": None,
        }
    mean = s["mean_per_device"]
    comm = mean["comm_s"] or 1e-30
    projection = costmodel.project(
        mean["compute_s"],
        grad_bytes,
        mean["comm_overlapped_s"] / comm,
        mean["sync_s"] / comm,
        s["devices"],
        hw,
    )
    return {
        "per_axis": per_axis,
        "gradient_bytes_per_step": grad_bytes,
        "projection": projection,
        "comm_dominates_at": costmodel.comm_dominates_at(projection),
    }


def _axis_row(
    rows: list[dict], mesh_shape: dict[str, int], hw: Hardware, axis: str, kind: str, v: dict
) -> dict | None:
    """One axis and kind of collective, per device-step: measured beside the alpha-beta model.

    `v` holds means over every device-step, steps without this collective counting as zero; its
    executions are counted the same way, so bytes / count is one execution's buffer however
    few of the traced steps ran it."""
    p = costmodel.group_size(mesh_shape, axis)
    if not p or not v["bytes"]:
        return None
    axes_order = list(mesh_shape)
    stride = 1
    for a in axes_order[axes_order.index(axis.split("+")[-1]) + 1 :]:
        stride *= mesh_shape[a]
    link = costmodel.link_for(hw, p, stride)
    count = sum(r["by_axis"].get(axis, {}).get(kind, {}).get("count", 0) for r in rows)
    count /= len(rows)
    predicted = costmodel.collective_time(kind, v["bytes"] / count, p, link) * count
    bus = v["bytes"] * costmodel.ring_bytes_factor(kind, p)
    return {
        "axis": axis,
        "kind": kind,
        "group_size": p,
        "bytes": v["bytes"],
        "measured_s": v["time_s"],
        "exposed_s": v["exposed_s"],
        "predicted_s": predicted,
        "bus_gbytes_per_s": bus / v["time_s"] / 1e9 if v["time_s"] else None,
    }


def warnings(report: dict, threshold: float = 0.25, drift: float = 1.5) -> list[str]:
    """Early warnings: exposed communication or sync over `threshold` of the step, or a step
    time p90 more than `drift` times p50 (stragglers, noisy neighbours)."""
    f = report["summary"]["fraction_of_step"]
    out = []
    if f["comm_exposed_s"] > threshold:
        out.append(
            f"exposed communication is {f['comm_exposed_s']:.0%} of the step (threshold "
            f"{threshold:.0%}): the network, not compute, sets the pace"
        )
    if f["sync_s"] > threshold:
        out.append(
            f"waiting for peers (sync) is {f['sync_s']:.0%} of the step: look at the stragglers"
        )
    st = report["summary"]["step_time_s"]
    if st["p50"] and st["p90"] > drift * st["p50"]:
        out.append(
            f"step time p90 {st['p90'] * 1e3:.1f} ms is over {drift}x p50 {st['p50'] * 1e3:.1f} ms"
        )
    wall = report["model"].get("comm_dominates_at")
    if wall:
        out.append(
            f"projection: at {wall} devices exposed communication would exceed compute "
            f"on {report['hardware']}"
        )
    return out


def print_report(report: dict, console: Console | None = None, warn: Console | None = None) -> None:
    """The breakdown's tables on `console` (stdout), its warnings on `warn` (stderr): a
    report redirected to a file is the report alone."""
    console = console or Console()
    warn = warn or Console(stderr=True)
    s = report["summary"]
    # The trace's path on a line of its own, never wrapped: a title would break it mid-name.
    console.print(f"trace: {report['source']}", highlight=False, soft_wrap=True)
    t = Table(title=f"step time per device, mean of {s['steps']} steps")
    for c in ("", "ms", "share"):
        t.add_column(c, justify="right" if c else "left")
    mean, frac = s["mean_per_device"], s["fraction_of_step"]
    t.add_row("step", f"{mean['step_s'] * 1e3:.2f}", "100%")
    for k, label in (
        ("compute_s", "compute"),
        ("comm_exposed_s", "communication, exposed"),
        ("sync_s", "  of which waiting for the slowest (sync)"),
        ("comm_overlapped_s", "communication, hidden"),
        ("outer_s", "communication of the outer step (replica groups)"),
        ("outer_exposed_s", "  of which exposed"),
        ("memcpy_exposed_s", "memcpy, exposed"),
        ("idle_s", "idle"),
    ):
        if k.startswith("outer") and not mean.get("outer_s"):
            continue  # no replica groups, or no outer step among the traced steps
        t.add_row(label, f"{mean[k] * 1e3:.2f}", f"{frac[k]:.1%}")
    console.print(t)
    if report["model"]["per_axis"]:
        a = Table(
            title=f"collectives per mesh axis and step, beside the alpha-beta model "
            f"({report['hardware']})"
        )
        # Names whole (no_wrap: a narrow console narrows the figures' headers first).
        for c in ("axis", "kind"):
            a.add_column(c, no_wrap=True)
        for c in ("group", "MB", "measured\nms", "exposed\nms", "model\nms", "bus\nGB/s"):
            a.add_column(c, justify="right")
        for r in report["model"]["per_axis"]:
            bw = f"{r['bus_gbytes_per_s']:.2f}" if r["bus_gbytes_per_s"] else "-"
            a.add_row(
                r["axis"],
                r["kind"],
                str(r["group_size"]),
                f"{r['bytes'] / 1e6:.3f}",
                f"{r['measured_s'] * 1e3:.2f}",
                f"{r['exposed_s'] * 1e3:.2f}",
                f"{r['predicted_s'] * 1e3:.3f}",
                bw,
            )
        console.print(a)
    for st in s["stragglers"][:5]:
        console.print(
            f"step {st['step']}: device {st['device']} arrived last; the others "
            f"waited {st['others_waited_s'] * 1e3:.2f} ms for it",
            highlight=False,
        )
    proj = report["model"]["projection"]
    if proj:
        line = ", ".join(
            f"N={r['devices']}: {r['efficiency']:.0%}"
            for r in proj
            if r["devices"] in (1, 8, 64, 512, 4096)
        )
        console.print(
            f"projected scaling efficiency ({report['hardware']}): {line}",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(report["model"]["projection_missing"], highlight=False)
    for w in warnings(report):
        warn.print(f"[yellow]warning:[/] {w}", highlight=False, soft_wrap=True)


def write(report: dict, json_path: pathlib.Path | None, png_path: pathlib.Path | None) -> None:
    if json_path:
        json_path.write_text(json.dumps(report, indent=1))
    if png_path:
        plot(report, png_path)


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report["steps"], key=lambda r: (r["step"], r["device"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{r['step']}/{r['device']}" for r in rows]
    bottom = [0.0] * len(rows)
    parts = [("compute_s", "compute", "#4c72b0")]
    axes = sorted({a for r in rows for a in r["by_axis"]})
    warm = ("#dd8452", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#ccb974")
    for i, axis in enumerate(axes):
        parts.append((axis, f"exposed comm: {axis}", warm[i % len(warm)]))
    parts += [("comm_overlapped_s", "hidden comm", "#c7d7ee"), ("idle_s", "idle", "#dddddd")]
    for key, label, color in parts:
        if key in axes:
            vals = [
                sum(v["exposed_s"] for v in r["by_axis"].get(key, {}).values()) * 1e3 for r in rows
            ]
        else:
            vals = [r[key] * 1e3 for r in rows]
        ax1.bar(range(len(rows)), vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax1.set_xlabel("step/device")
    ax1.set_ylabel("ms")
    ax1.set_title("where each step went")
    ax1.legend(fontsize=7)
    _plot_projection(ax2, report)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_projection(ax, report: dict) -> None:
    ax.set_title(f"fleet-law projection ({report['hardware']})")
    proj = report["model"]["projection"]
    if not proj:
        ax.text(0.5, 0.5, "no projection:\nno compiled HLO and mesh", ha="center", va="center")
        ax.set_axis_off()
        return
    ns = [r["devices"] for r in proj]
    ax.loglog(ns, [r["compute_s"] for r in proj], label="T_compute/N")
    ax.loglog(ns[1:], [r["comm_s"] for r in proj[1:]], label="T_comm(N)")  # none at N=1
    ax.loglog(ns, [r["step_s"] for r in proj], label="T_step(N)", linewidth=2)
    ax.set_xlabel("devices N")
    ax.set_ylabel("s")
    ax.legend(fontsize=7)
