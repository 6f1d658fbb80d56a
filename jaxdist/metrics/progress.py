"""A run's progress as its user reads it on stderr: the periodic step line (step N/total, loss,
tokens/s, time left) and, when stderr is a terminal, a bar under those lines carrying the same.

Not a terminal (a file, a pipe, a CI log): the plain lines only, no bar and no control
characters, and no line broken at 80 columns (`console_for`: rich wraps to 80 when it cannot
ask a terminal its width, cutting a step line or a table's cell mid-field). Time left is the
recent median step time times the steps remaining (evaluations and checkpoint saves are not
counted: the --log-every help says so); it is left out until a steady step exists (the first
steps compile and warm up)."""

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

# The width a console takes when its output is no terminal: a table's natural width, never
# its cells wrapped (a wider table than this is cut; none of a run's comes near it).
FILE_WIDTH = 1000


def console_for(stderr: bool = True, quiet: bool = False) -> Console:
    """The console of a run's output: a terminal's as rich makes it; a file's or a pipe's
    (Slurm, nohup, CI) never wraps a line and draws tables at their natural width, so that
    each line a log holds is the line as printed."""
    console = Console(stderr=stderr, quiet=quiet)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, quiet=quiet, width=FILE_WIDTH, soft_wrap=True)


def duration(seconds: float) -> str:
    """4.9 s, 3m05s, 2h07m: as short as the size allows."""
    if seconds < 59.95:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def recent_median(step_times: list[float]) -> float | None:
    """The median of the last 100 steady step times (bounded work per step, and it follows a
    run whose speed drifts); None before any. The watchdog and the time left both read it."""
    return float(np.median(step_times[-100:])) if step_times else None


def time_left(median_step_s: float | None, steps_left: int) -> float | None:
    """The recent median step time times the steps left; None before a steady step, or on the
    last step."""
    if median_step_s is None or steps_left <= 0:
        return None
    return median_step_s * steps_left


def step_of(s: int, total: int) -> str:
    """`step  9/30`: the step padded to the total's width, so that the lines align."""
    return f"step {s:>{len(str(total))}}/{total}"


def step_line(rec: dict, total: int, left: float | None, mark: str = "") -> str:
    """`step 10/30  loss 4.0741  grad_norm 2.753    235.4 ms  8,701 tok/s  4.9 s left`, then
    `mark` (what else the step did: an outer round of replica groups, a compile)."""
    mfu = f" mfu {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""
    eta = f"  {duration(left)} left" if left is not None else ""
    # Multi-token prediction's own loss, beside the next-token loss it never changes.
    mtp = f"  mtp {rec['mtp_loss']:.4f}" if rec.get("mtp_loss") is not None else ""
    return (
        f"{step_of(rec['step'], total)}  loss {rec['loss']:.4f}{mtp}  "
        f"grad_norm {rec['grad_norm']:.3f}  {rec['step_time_s'] * 1e3:7.1f} ms  "
        f"{rec['tokens_per_s']:,.0f} tok/s{mfu}{eta}{'  ' + mark if mark else ''}"
    )


class Bar:
    """The bar under the log lines (a terminal only; otherwise it draws nothing): step/total,
    loss, tokens/s and time left, redrawn each step; gone when the loop ends (transient)."""

    def __init__(self, console: Console, total: int, start: int):
        self.total, self.start = total, start
        self.progress = Progress(
            TextColumn("{task.fields[step]}"),
            BarColumn(),
            TextColumn("{task.description}"),
            console=console,
            transient=True,
            disable=not console.is_terminal or console.quiet,
        )
        self.task = None

    def __enter__(self) -> "Bar":
        self.progress.__enter__()
        self.task = self.progress.add_task(
            "compiling the step (a minute for a large model)",
            total=self.total,
            completed=self.start,
            step=f"step {self.start}/{self.total}",
        )
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, rec: dict, left: float | None) -> None:
        """Step rec["step"] finished."""
        if self.task is None:  # outside the loop (no bar)
            return
        eta = f"  {duration(left)} left" if left is not None else ""
        self.progress.update(
            self.task,
            completed=rec["step"] + 1,
            step=f"step {rec['step']}/{self.total}",
            description=f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s{eta}",
        )
