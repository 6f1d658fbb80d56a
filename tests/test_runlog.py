"""What a run tells a script that reads its output (a pipe, a file: no terminal): replica
groups' outer rounds counted, timed and sized in every place a run reports (step lines,
metrics.jsonl, summary.json, the summary table, TensorBoard); compiles charged as compiles
(goodput) and never taken for slow steps (the watchdog); no line broken at 80 columns; the idle
time before a deliberate "train further" left out of goodput's wall-clock."""

import io
import json
import re
import time

import pytest
from jax import monitoring
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxdist.cli.main import main
from jaxdist.cluster.watchdog import Watchdog
from jaxdist.config import OptimConfig
from jaxdist.layout import Layout, StepConfig, SyncConfig
from jaxdist.metrics import compiles
from jaxdist.metrics.goodput import PARTS, Ledger, print_report, report
from jaxdist.metrics.outer import first_round, never_meet
from jaxdist.metrics.records import read_metrics
from jaxdist.optim import make_optimizer
from jaxdist.parallel import rounds
from jaxdist.planning import sync as sync_price
from jaxdist.step import build
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from models.transformer import Transformer
from tests.helpers import cli, mesh_for

# tests/test_replica.py's run (the same program: the session's compile cache holds it), with
# a line every 5 steps: the rounds (after steps 3 and 7) have lines of their own.
MESH = "replica=2,fsdp=2,tensor=2"
RUN = ["train", "--sync-every", "4", "--sync-dtype", "int8", "--mesh", MESH, "--steps", "10"]
RUN += ["--batch-size", "8", "--seq-len", "32", "--log-every", "5", "--checkpoint-every", "100"]
STEP_LINE = re.compile(
    r"step +\d+/\d+  loss \d+\.\d{4}  grad_norm \d+\.\d{3} +\d+\.\d ms  [\d,]+ tok/s"
)


@pytest.fixture(scope="module")
def replica_run(tmp_path_factory):
    """The run, its output through pipes (as Slurm, nohup or CI hold it)."""
    run_dir = tmp_path_factory.mktemp("rounds") / "a-run-directory-whose-path-is-long-enough"
    result = cli(*RUN, "--run-dir", str(run_dir), env={"COLUMNS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def _exchange_bytes() -> float:
    """One device's bytes of a whole outer exchange, as `plan` prices it (planning.sync)."""
    mc = get_model_config("tiny", seq_len=32)
    mesh = mesh_for(MESH)
    sync = SyncConfig(sync_every=4, sync_dtype="int8")
    layout = Layout.on(mesh, STANDARD_RULES, StepConfig(), batch_size=8, seq_len=32, sync=sync)
    tx, lr = make_optimizer(OptimConfig(), 10)
    jitted = build(lambda r: Transformer(mc, r), tx, lr, layout, mesh)
    return sum(sync_price.exchange_bytes(jitted.abstract_params, layout).values())


def test_each_round_is_a_record_a_marked_line_and_the_summarys_rows(replica_run):
    run_dir, result = replica_run
    found = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "round"]
    assert [(r["round"], r["step"], r["fragments"]) for r in found] == [(1, 3, [0]), (2, 7, [0])]
    # Its bytes are the plan's price of the exchange; its time the step's, above a plain one.
    price = _exchange_bytes()
    assert price > 0 and all(r["bytes"] == price for r in found)
    assert all(r["seconds"] is None or 0 <= r["seconds"] <= r["step_time_s"] for r in found)
    assert found[1]["seconds"] is not None  # plain steps 4..6 came before it
    # The first round's program compiled apart from the plain step's: said, not its time.
    assert found[0]["compile_s"] > 0 and "compile_s" not in found[1]
    # The round's steps have lines of their own (--log-every 5), marked; no other step does.
    marked = [x for x in result.stderr.splitlines() if "groups met" in x]
    assert [x.split("/")[0].split()[-1] for x in marked] == ["3", "7"], result.stderr
    assert all(STEP_LINE.match(x) and "MB sent per device" in x for x in marked)
    assert "| round 1: groups met" in marked[0] and "its program compiled first" in marked[0]
    summary = json.loads((run_dir / "summary.json").read_text())["rounds"]
    assert (summary["count"], summary["every_steps"], summary["last_step"]) == (2, 4, 7)
    assert summary["steps_after_last"] == 2 and summary["bytes_per_round"] == price
    assert 0 <= summary["outer_share"] < 1
    rows = {
        "replica rounds (groups met)": "2 (every 4 steps)",
        "sent per round, per device": f"{price / 1e6:.3f} MB",
        "steps since the last round": "2 (not in the outer weights",
    }
    for key, value in rows.items():  # key and value on one line of stdout
        assert any(key in x and value in x for x in result.stdout.splitlines()), result.stdout


def test_a_rounds_time_and_bytes_are_tensorboard_scalars(replica_run):
    acc = EventAccumulator(str(replica_run[0] / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("outer/round")] == [(3, 1.0), (7, 2.0)]
    assert [e.step for e in acc.Scalars("outer/bytes")] == [3, 7]
    assert [e.step for e in acc.Scalars("outer/step_time_s")] == [3, 7]


def test_no_line_of_a_piped_run_is_broken_and_no_compile_is_a_slow_step(replica_run):
    run_dir, result = replica_run
    err, out = result.stderr.splitlines(), result.stdout.splitlines()
    # The header names the run directory, far past 80 columns: on one line.
    header = [x for x in err if x.startswith("jaxdist tiny")]
    assert len(header) == 1 and header[0].endswith(f"run dir {run_dir}"), err
    steps = [x for x in err if x.startswith("step ")]
    assert steps and all(STEP_LINE.match(x) for x in steps), err
    # A step line's continuation would start a line of its own with a fragment.
    assert not [x for x in err if re.match(r"\s*(\d[\d,.]* (ms|tok/s|s left)|MB sent)", x)]
    # The summary's longest key, whole, beside its value.
    assert any("goodput (productive / all attempts' wall)" in x and "%" in x for x in out), out
    assert "slow step" not in result.stderr


def test_groups_that_would_never_meet_are_warned_of_first_in_one_line(tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("")  # the run directory cannot be made: the run ends before compiling
    args = ["train", "--mesh", "replica=2,fsdp=4", "--sync-every", "100", "--steps", "12"]
    main([*args, "--run-dir", str(taken), "--compile-cache", "off"])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "jaxdist: warning: the 2 replica groups first meet after step 99 (--sync-every 100), "
        "but the run ends after step 11: they never meet, and the outer weights (what eval and "
        "export read) stay the first ones; pass --steps 100 or more, or --sync-every 12 or less"
    )


def test_never_meet_follows_the_schedule_the_step_runs():
    for sync, steps in [
        (SyncConfig(sync_every=16), 16),
        (SyncConfig(sync_every=16, sync_delay=2), 17),
        (SyncConfig(sync_every=16, sync_fragments=4), 4),
    ]:
        first = min(s for s in range(40) if (rounds.action(sync, s) or rounds.Action()).send)
        assert first_round(sync) == first == steps - 1
        assert never_meet(sync, 2, steps) is None  # the last step runs the first round
        assert "--steps" in never_meet(sync, 2, steps - 1)
    assert never_meet(SyncConfig(sync_every=16), 1, 2) is None  # one group: nothing to meet
    assert "or a smaller --sync-every" in never_meet(SyncConfig(sync_every=16, sync_delay=2), 2, 5)


# --- compiles, as JAX announces them ---


def _compile(seconds: float) -> None:
    """A compile as JAX reports one: its start, then its duration (jax._src.dispatch's calls)."""
    event = "/jax/core/compile/backend_compile_duration"
    monitoring.record_scalar(event, time.time(), fun_name="f")
    time.sleep(seconds)
    monitoring.record_event_duration_secs(event, seconds, fun_name="f")


def _watchdog() -> tuple[Watchdog, io.StringIO]:
    out = io.StringIO()
    dog = Watchdog(Console(file=out, width=1000), factor=3, min_seconds=0.2, poll_s=0.02)
    dog.finished(0, 0.01)
    return dog, out


def test_the_watchdog_does_not_take_a_compile_or_an_evaluation_for_a_slow_step():
    dog, out = _watchdog()
    with dog:
        _compile(0.5)  # two and a half times the alarm's threshold, compiling
        dog.finished(1, 0.01)
        with dog.between_steps():
            time.sleep(0.4)  # an evaluation
        assert out.getvalue() == ""
        time.sleep(0.4)  # then a step that does not finish
    line = out.getvalue()
    # Said for a person: how long, against what, the threshold and its flag, what is not
    # counted, and when it becomes a hang.
    assert line.startswith("slow step 2: 0.") and "against a median step of 0.01 s" in line
    assert "past 3 x the median and at least 0.2 s, --slow-step-factor" in line
    assert "compile time is not counted" in line and "(--hang-timeout)" in line
    assert "not yet arrived" not in line  # one process: nobody to wait for


def test_goodput_charges_a_compile_to_compile_wherever_it_happens():
    ledger = Ledger()
    with ledger.part("eval"):
        _compile(0.3)  # the first evaluation compiles
    ledger.mark("step")
    _compile(0.2)  # a step's new program
    ledger.step(5)
    assert ledger.seconds["compile"] == pytest.approx(0.5, abs=0.05)
    assert ledger.seconds["eval"] < 0.05 and ledger.seconds["productive"] < 0.05


def test_clock_counts_nested_phases_once_and_each_thread_apart():
    clock = compiles.Clock()
    before = clock.seconds()
    outer, inner = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
    )
    monitoring.record_scalar(outer, 0.0)
    monitoring.record_scalar(inner, 0.0)
    time.sleep(0.1)
    assert clock.running() >= 0.1 and clock.seconds() == before
    monitoring.record_event_duration_secs(inner, 0.1)
    monitoring.record_event_duration_secs(outer, 0.1)
    assert clock.running() == 0.0 and clock.seconds() - before == pytest.approx(0.1, abs=0.03)


# --- goodput over attempts ---


def _attempt(start: float, first: int, last: int, finished: bool) -> list[dict]:
    parts = dict.fromkeys(PARTS, 1.0)  # 8 s each
    said = {"process_start": start, "first_step": first, "recompute": None}
    return [
        {"step": first, "loss": 1.0, "goodput_s": parts, "attempt": said},
        {"step": last, "loss": 1.0, "goodput_s": parts},
        *([{"event": "end", "goodput_s": parts}] if finished else []),
    ]


def test_the_idle_time_before_training_a_finished_run_further_is_not_lost():
    # A run finished (100 s to 108 s); its user trained it further an hour later (3708 s).
    rep = report(_attempt(100.0, 0, 9, True) + _attempt(3708.0, 10, 19, True))
    first, _ = rep["attempts"]
    assert first["parts_s"]["between"] == 0.0 and first["idle_s"] == pytest.approx(3600.0)
    assert rep["idle_s"] == pytest.approx(3600.0)
    assert rep["wall_s"] == pytest.approx(16.0) and rep["goodput"] == pytest.approx(2 / 16)
    console = Console(file=io.StringIO(), width=200)
    print_report(rep, console)
    assert "not counted: 3600.00 s idle between a finished run" in console.file.getvalue()
    # An attempt that was killed: the gap is lost time, as before.
    killed = report(_attempt(100.0, 0, 9, False) + _attempt(3708.0, 5, 19, True))
    assert killed["attempts"][0]["parts_s"]["between"] == pytest.approx(3600.0)
    assert killed["idle_s"] == 0.0 and killed["wall_s"] == pytest.approx(3616.0)
