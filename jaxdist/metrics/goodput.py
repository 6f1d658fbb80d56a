"""Goodput: where a run's wall-clock went, over all its attempts, from the first process start
to the last record.

The loop feeds a `Ledger` (one per attempt, i.e. per process). Every second from the process's
start goes to exactly one part: `mark(part)` gives the time since the previous mark to `part`,
so an attempt's parts add up to its span by construction; the seconds JAX spent compiling
within it (jaxdist.metrics.compiles: a new outer-step program, the first evaluation) go to
"compile" whatever part they fell in. The running totals are stamped into
every record metrics.jsonl gets, so a killed attempt's accounting survives up to its last
record. `report` rebuilds the parts from metrics.jsonl and adds the time between attempts: from
an attempt's last record to the next process's start, which holds a killed attempt's lost tail.
The gap after an attempt that finished its run is left out of the wall-clock (`idle`): the next
attempt is a deliberate "train further", started whenever its user chose.
Goodput = productive seconds / wall-clock.
"""

import contextlib
import os
import pathlib
import time

from jaxdist.cluster import restarts
from jaxdist.errors import ConfigError
from jaxdist.metrics.compiles import Clock
from jaxdist.metrics.records import read_metrics

# In the order of an attempt's life; "between" is the reader's, after each attempt.
PARTS = (
    "startup",  # process start to the loop: imports, devices, mesh, data checks, the step built
    "restore",  # restoring the newest checkpoint (or initialising, on a fresh start)
    "compile",  # the attempt's first step, and every other compile (or compile-cache load)
    "productive",  # steps no earlier attempt had run
    "recomputed",  # steps an earlier attempt ran past its last checkpoint, run again
    "data",  # building and placing each batch
    "checkpoint",  # the loop blocked in a save, and the wait for the last commit
    "eval",  # held-out evaluation
)
ALL_PARTS = (*PARTS, "between")


def process_start() -> float:
    """This process's start, Unix seconds. psutil's create_time adds the boot time, which Linux
    gives in whole seconds: up to a second too early, a second that startup would be charged
    with. On Linux the start is read against the boot clock instead (to the kernel's tick)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, AttributeError, ValueError, IndexError):
        import psutil  # an orbax-checkpoint dependency

        return psutil.Process().create_time()


class Ledger:
    """One attempt's wall-clock, split into PARTS as the loop runs.

    Time outside any `part(...)` is step time: it is held until the step's scalars arrive
    (`step`), then goes to compile, productive or recomputed, by what that step was."""

    def __init__(self) -> None:
        # Made just before the restore: everything since the process started was startup.
        self.process_start = process_start()
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.seconds["startup"] = max(0.0, time.time() - self.process_start)
        self.steps = {"productive": 0, "recomputed": 0}
        self._t = time.perf_counter()
        self._compiles = Clock()  # this thread's: the loop's
        self._compiled = self._compiles.seconds()
        self._held = 0.0  # step time since the last finished step
        self.start, self.redo_until, self._next = 0, -1, 0
        self._announce: dict | None = None

    def mark(self, part: str) -> None:
        """The time since the previous mark goes to `part` ("step": held for the next step),
        but for the seconds JAX spent compiling meanwhile, which go to compile."""
        now, compiled = time.perf_counter(), self._compiles.seconds()
        spent = now - self._t
        moved = min(max(0.0, compiled - self._compiled), spent)
        self.seconds["compile"] += moved
        if part == "step":
            self._held += spent - moved
        else:
            self.seconds[part] += spent - moved
        self._t, self._compiled = now, compiled

    @contextlib.contextmanager
    def part(self, name: str):
        self.mark("step")
        try:
            yield
        finally:
            self.mark(name)

    def begin(self, start: int, past: list[dict]) -> None:
        """After the restore: the attempt's first step, and which steps it recomputes (those
        the log holds from earlier attempts, `past`, as resume's message says)."""
        self.mark("restore")
        logged = [r["step"] for r in past if "loss" in r]
        self.start = self._next = start
        self.redo_until = max(logged) if logged and max(logged) >= start else start - 1
        redo = [start, self.redo_until] if self.redo_until >= start else None
        # Announced in the attempt's first record, not a line of its own: tools that count
        # the log's lines (tests that kill a run after n of them) see the lines they did.
        self._announce = {"process_start": self.process_start, "first_step": start}
        self._announce["recompute"] = redo

    def _kind(self, s: int) -> str:
        if s == self.start:
            return "compile"
        return "recomputed" if s <= self.redo_until else "productive"

    def step(self, s: int) -> None:
        """Step s's scalars arrived: the step time held since the last step is s's."""
        self.mark("step")
        self.seconds[self._kind(s)] += self._held
        self._held, self._next = 0.0, s + 1
        self.steps["recomputed" if s <= self.redo_until else "productive"] += 1

    def fields(self) -> dict:
        """The totals so far, stamped into each record; step time still held counts for the
        step in flight, so the parts add up to the time from process start to now."""
        self.mark("step")
        seconds = dict(self.seconds)
        seconds[self._kind(self._next)] += self._held
        out = {
            "goodput_s": {k: round(v, 6) for k, v in seconds.items()},
            "goodput_steps": dict(self.steps),
        }
        if self._announce:
            out["attempt"], self._announce = self._announce, None
        return out


def attempts(records: list[dict]) -> list[dict]:
    """Each attempt's parts, from its first record (which says where it started) and its last;
    records older than the first attempt (a run logged before goodput) are left out."""
    found: list[dict] = []
    for r in records:
        if "attempt" in r:
            found.append({"first": r["attempt"], "last": r, "last_step": None})
        elif found and "goodput_s" in r:
            found[-1]["last"] = r
        if found and "loss" in r:
            found[-1]["last_step"] = r["step"]
    rows = []
    for i, a in enumerate(found):
        first, last = a["first"], a["last"]
        parts = {p: last.get("goodput_s", {}).get(p, 0.0) for p in PARTS}
        start = first["process_start"]
        rows.append(
            {
                "attempt": i + 1,
                "process_start": start,
                "end": start + sum(parts.values()),
                "first_step": first["first_step"],
                "last_step": a["last_step"],
                "recompute": first.get("recompute"),
                "steps": {"productive": 0, "recomputed": 0, **last.get("goodput_steps", {})},
                "finished": last.get("event") == "end" and not last.get("stopped"),
                "stopped": last.get("stopped"),  # the signal that stopped it, saved
                "parts_s": {**parts, "between": 0.0},
            }
        )
    for a, b in zip(rows, rows[1:], strict=False):
        gap = b["process_start"] - a["end"]
        # After a finished run, the next attempt trains further when its user asks: not lost.
        a["idle_s"], a["parts_s"]["between"] = (gap, 0.0) if a["finished"] else (0.0, gap)
    return rows


def report(records: list[dict], restarted: list[dict] = ()) -> dict:
    """The run's accounting: per attempt, and in total over them all. `restarted`: the
    restarts recorded by `launch --max-restarts` or the Slurm loop; each is the cause of the
    end of the attempt before it (the last attempt whose last record precedes it)."""
    rows = attempts(records)
    if not rows:
        return {
            "goodput": None, "wall_s": 0.0, "idle_s": 0.0, "parts_s": {}, "attempts": [],
            "restarts": 0,
        }  # fmt: skip
    for r in restarted:
        # An attempt that failed before its first step (a restore error) left no record: its
        # time is in the gap after the one before, and its cause joins that one's.
        before = [a for a in rows if a["end"] <= r["time"]]
        if before:
            had = before[-1].get("restart_cause")
            before[-1]["restart_cause"] = f"{had}; then {r['cause']}" if had else r["cause"]
    total = {p: sum(r["parts_s"][p] for r in rows) for p in ALL_PARTS}
    idle = sum(r.get("idle_s", 0.0) for r in rows)
    wall = rows[-1]["end"] - rows[0]["process_start"] - idle
    return {
        "goodput": total["productive"] / wall if wall > 0 else None,
        "wall_s": wall,
        "idle_s": idle,  # between a finished run and training it further: not in wall_s
        "parts_s": total,
        "recomputed_steps": sum(r["steps"]["recomputed"] for r in rows),
        "restarts": len(restarted),
        "attempts": rows,
    }


def read_restarts(run_dir) -> list[dict]:
    """The run's restarts (jaxdist.cluster.restarts), oldest first; a torn last line, a
    restarter killed mid-write, is skipped."""
    return read_metrics(pathlib.Path(run_dir) / restarts.FILE)


def read_report(run_dir: pathlib.Path) -> dict:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ConfigError(f"{path} does not exist; pass the --run-dir of a jaxdist train run")
    out = report(read_metrics(path), read_restarts(run_dir))
    if not out["attempts"]:
        raise ConfigError(
            f"{path} holds no goodput records (a run logged before goodput accounting); "
            "rerun it with this jaxdist to account for its time"
        )
    return out


def totals(rep: dict) -> dict:
    """The summary.json view: the run's totals, without the per-attempt rows."""
    return {**{k: v for k, v in rep.items() if k != "attempts"}, "attempts": len(rep["attempts"])}


def print_report(rep: dict, console=None) -> None:
    """Parts as rows, attempts as columns (a run has few), then the run's total and share."""
    from rich.table import Table

    from jaxdist.metrics.progress import console_for

    console = console or console_for(stderr=False)
    rows, wall = rep["attempts"], rep["wall_s"]
    table = Table(title=f"goodput {rep['goodput']:.1%} of {wall:.1f} s wall-clock")
    table.add_column("seconds")
    for r in rows:
        table.add_column(f"attempt {r['attempt']}", justify="right")
    table.add_column("all", justify="right")
    table.add_column("share", justify="right")

    def steps(r: dict) -> str:
        return f"{r['first_step']}..{r['last_step']}" if r["last_step"] is not None else "-"

    table.add_row("steps", *[steps(r) for r in rows], "", "")
    redone = [str(r["steps"]["recomputed"]) for r in rows]
    table.add_row("steps redone", *redone, str(rep["recomputed_steps"]), "")
    for p in ALL_PARTS:
        cells = [f"{r['parts_s'][p]:.2f}" for r in rows]
        total = rep["parts_s"][p]
        table.add_row(p, *cells, f"{total:.2f}", f"{total / wall:.1%}")
    ends = [sum(r["parts_s"].values()) for r in rows]
    table.add_row("total", *[f"{t:.2f}" for t in ends], f"{wall:.2f}", "100%", end_section=True)
    status = [_ended(r, "killed") for r in rows[:-1]] + [_ended(rows[-1], "running or killed")]
    table.add_row("ended", *status, "", "")
    if rep.get("idle_s"):
        table.caption = (
            f"not counted: {rep['idle_s']:.2f} s idle between a finished run and the attempt "
            "that trained it further"
        )
    console.print(table)


def _ended(row: dict, otherwise: str) -> str:
    """How an attempt ended: finished, stopped by a signal (saved), or what restarted it."""
    if row["finished"]:
        return "finished"
    if row.get("restart_cause"):
        return row["restart_cause"]
    return f"stopped ({row['stopped']})" if row.get("stopped") else otherwise


COLORS = {
    "startup": "#9e9e9e",
    "restore": "#8d6e63",
    "compile": "#ffb300",
    "productive": "#43a047",
    "recomputed": "#e53935",
    "data": "#1e88e5",
    "checkpoint": "#8e24aa",
    "eval": "#00acc1",
    "between": "#424242",
}


def plot(rep: dict, out: pathlib.Path) -> None:
    """One stacked horizontal bar per attempt, its parts in seconds, then the gap after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rep["attempts"]
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.45 * len(rows)))
    labels = [f"attempt {r['attempt']}" for r in rows]
    left = [0.0] * len(rows)
    for p in ALL_PARTS:
        widths = [r["parts_s"][p] for r in rows]
        ax.barh(labels, widths, left=left, color=COLORS[p], label=p)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"goodput {rep['goodput']:.1%} of {rep['wall_s']:.1f} s")
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
