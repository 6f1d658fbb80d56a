"""The progress a run shows on stderr (jaxdist.metrics.progress): the step line, and the bar
under the lines on a terminal (a rich Console forced to be one, into a buffer)."""

import io
import re

from rich.console import Console

from jaxdist.metrics.progress import Bar, duration, recent_median, step_line, time_left

REC = {
    "step": 10,
    "loss": 4.07412,
    "grad_norm": 2.7531,
    "step_time_s": 0.2354,
    "tokens_per_s": 8701.2,
    "mfu": None,
}


def test_duration_is_short_at_every_size():
    assert [duration(x) for x in (4.94, 59.96, 185, 7625)] == ["4.9 s", "1m00s", "3m05s", "2h07m"]


def test_time_left_is_the_recent_median_times_the_steps_left():
    assert time_left(recent_median([]), 20) is None  # step 0 compiles: nothing to say yet
    # a slow step (a save) does not sway it
    assert time_left(recent_median([0.2, 0.3, 9.0]), 20) == 0.3 * 20
    assert time_left(recent_median([0.2]), 0) is None  # the last step


def test_step_line_has_the_total_and_time_left():
    line = step_line(REC, 30, 4.94)
    assert line == ("step 10/30  loss 4.0741  grad_norm 2.753    235.4 ms  8,701 tok/s  4.9 s left")
    assert step_line({**REC, "step": 0, "mfu": 0.41}, 300, None) == (
        "step   0/300  loss 4.0741  grad_norm 2.753    235.4 ms  8,701 tok/s mfu 41.0%"
    )
    # Multi-token prediction's loss beside the next-token loss, only where the model has it.
    assert step_line({**REC, "mtp_loss": 4.51234}, 30, None).startswith(
        "step 10/30  loss 4.0741  mtp 4.5123  grad_norm 2.753"
    )


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=100), buf


def test_bar_on_a_terminal_carries_step_loss_throughput_and_time_left():
    console, buf = _console(terminal=True)
    with Bar(console, total=30, start=0) as bar:
        bar.update(REC, 4.94)
        console.print(step_line(REC, 30, 4.94), highlight=False)  # a log line, above the bar
    out = buf.getvalue()
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    assert "\x1b[" in out and "step 0/30" in plain and "compiling" in plain  # while step 0 runs
    assert "step 10/30  loss 4.0741  grad_norm" in plain  # the line, printed above the bar
    assert re.search(r"step 10/30 ━+╸?━* loss 4.0741  8,701 tok/s  4.9 s left", plain), plain


def test_no_bar_when_not_a_terminal():
    console, buf = _console(terminal=False)
    with Bar(console, total=30, start=0) as bar:
        bar.update(REC, 4.94)
        console.print(step_line(REC, 30, 4.94))
    assert buf.getvalue() == step_line(REC, 30, 4.94) + "\n"
