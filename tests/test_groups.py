"""Replica groups as jobs of their own (`jaxdist launch --groups M`, jaxdist.groups): three
groups of one process and two fake CPU devices each, on loopback, tiny-llama, H = 4.

- kill -9 of group 2 mid-round: groups 0 and 1 keep their processes, lose at most one round and
  stall at most the heartbeat timeout plus 2 s; group 2 restarts alone, heals from a peer and
  takes part again within two rounds; all three end with bitwise equal outer weights, equal to
  a one-process replay of rounds.jsonl and heals.jsonl;
- a stopped group (SIGSTOP) and a killed lighthouse: the others go on, no round lost to the
  lighthouse;
- a whole fleet launched again from its groups' checkpoints resumes exactly (-m experiment: three
  fleets);
- bad settings end in one line (these need no sidecar).

The fleet tests need the [ft] extra's sidecar (JAXDIST_FT_PYTHON); without it they skip, naming
it. Each fault scenario takes under a minute alone on two idle cores (about 20 s of it the
three groups' first compile, side by side; the killed group's case about 10 s more replaying).
"""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxdist.groups import accounting, fleet
from tests.extras import FT_PYTHON_VAR, needs_ft
from tests.helpers import CLI_ENV, JAXDIST, cli

H = 4
HEARTBEAT_S = 3.0
TRAIN = [
    "train", "--model", "tiny-llama", "--mesh", "replica=3,data=2", "--sync-every", str(H),
    "--batch-size", "12", "--log-every", "4", "--checkpoint-every", "1000",
]  # fmt: skip


def _launch(run_dir: pathlib.Path, steps: int, *extra: str) -> subprocess.Popen:
    cmd = [
        *JAXDIST, "launch", "--groups", "3", "--processes", "1", "--devices-per-process", "2",
        "--max-restarts", "1", "--heartbeat-timeout", str(HEARTBEAT_S), *extra, "--",
        *TRAIN, "--steps", str(steps), "--run-dir", str(run_dir),
    ]  # fmt: skip
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=CLI_ENV)


def _lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait(what, proc: subprocess.Popen, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        assert proc.poll() is None, f"the fleet ended (exit {proc.returncode}) before {what}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _pids(run_dir: pathlib.Path, group) -> list[int]:
    return [x["pid"] for x in _lines(run_dir / "launch.jsonl") if x["group"] == group]


def _end(proc: subprocess.Popen, run_dir: pathlib.Path) -> None:
    try:
        assert proc.wait(timeout=300) == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def _replayed(run_dir: pathlib.Path, steps: int, extra: list[str] = ()) -> np.ndarray:
    """The outer weights a one-process replay of the records computes (in a process of two
    devices, as each group ran; `extra`: the fleet's further train flags)."""
    train = [*TRAIN, *extra, "--steps", str(steps), "--run-dir", "x"]
    args, sync, batch, _ = fleet.group_args(train, 3)
    script = f"""
import sys, numpy as np, tyro
from jaxdist.cli.cmd_train import Train
from jaxdist.cli.options import setup
from jaxdist.config import DataConfig, RunConfig
from jaxdist.groups import member, replay
from jaxdist.layout import SyncConfig
from jaxdist.train import prepare
from models.presets import model_spec
args = tyro.cli(Train, args={args[1:] + ["--devices", "cpu:2"]!r})
mesh, layout, mc, args = setup(args)
model = model_spec(mc)
data = DataConfig(path=None, batch_size=args.batch_size, seed=args.loop.seed)
config = RunConfig(args.optim, data, args.step, args.loop, args.checkpoint, args.eval, None)
jitted, _ = prepare(model, mesh, layout.rules, config)
rows = range(0, args.batch_size)
of = lambda g: member.batches(g, 3, {batch}, data, model.seq_len, model.vocab_size, rows)
rounds, heals = replay.read({str(run_dir)!r})
trace = []
outer = replay.replay(jitted, of, rounds, heals, SyncConfig(**{dataclasses.asdict(sync)!r}), trace)
print(trace)
np.savez({str(run_dir / "replayed.npz")!r}, *outer.params)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=CLI_ENV, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    with np.load(run_dir / "replayed.npz") as z:
        return np.concatenate([z[k].ravel() for k in sorted(z.files, key=lambda k: int(k[4:]))])


def _finals(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads((run_dir / "groups" / str(g) / "final.json").read_text()) for g in range(3)]


def _rounds(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]


def _outer(run_dir: pathlib.Path, group: int) -> np.ndarray:
    with np.load(run_dir / "groups" / str(group) / "outer.npz") as z:
        return np.concatenate([z[k].ravel() for k in sorted(z.files, key=lambda k: int(k[4:]))])


# Three groups' processes and sidecars for most of a minute, then the replay: the suite's 15
# minutes on CI's two cores do not hold it, so it runs with -m experiment (the issue's
# scenarios, each apart). 12 rounds: group 2 is killed after the third and back by about the
# sixth (its restart loads the programs its peers compiled, from the compile cache they share).
@needs_ft
@pytest.mark.experiment
def test_a_killed_group_restarts_alone_heals_and_the_fleet_ends_equal(tmp_path):
    run_dir, steps = tmp_path / "run", 48
    proc = _launch(run_dir, steps)
    try:
        _wait(lambda: len(_lines(run_dir / "rounds.jsonl")) >= 3, proc)
        time.sleep(0.2)  # into the next round's inner steps
        killed_at = time.time()
        os.kill(_pids(run_dir, 2)[0], signal.SIGKILL)
        _end(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    rounds = _lines(run_dir / "rounds.jsonl")
    heals = _lines(run_dir / "heals.jsonl")
    # Groups 0 and 1 kept their one process each; group 2 was started again, alone.
    assert [len(_pids(run_dir, g)) for g in range(3)] == [1, 1, 2]
    # At most one round lost: the committed rounds end every H steps, at most one gap.
    assert rounds[-1]["step"] == steps - 1
    assert len(rounds) >= steps // H - 1
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
    # The first round after the kill waited at most the heartbeat timeout plus 2 s.
    after = [r for r in rounds if r["time"] > killed_at]
    assert after[0]["groups"] == [0, 1]
    assert after[0]["time"] - killed_at <= HEARTBEAT_S + 2 + 1.0, after[0]  # + the round's steps
    # Group 2 healed from a live peer and takes part again within two rounds. (A group whose
    # first compile ran past the join timeout heals at the first rounds too: the others'.)
    healed = [h for h in heals if h["round"] > 2]
    assert len(healed) == 1 and healed[0]["group"] == 2 and healed[0]["from"] in (0, 1), heals
    back = [r["round"] for r in rounds if 2 in r["groups"] and r["round"] > healed[0]["round"]]
    assert back and back[0] <= healed[0]["round"] + 2, (heals, rounds)
    # `jaxdist goodput` names the fault and what it cost: the rounds group 2 missed, their rows.
    rep = accounting.fleet_report(run_dir)
    (fault,) = [f for f in rep["faults"] if "restarted" not in f["cause"]]
    assert fault["cause"] == "group 2: process 0 killed by SIGKILL"
    assert fault["healed_from"] in (0, 1)
    missed = [r for r in rounds if r["time"] > killed_at and 2 not in r["groups"]]
    assert fault["rounds_missed"] == len(missed) >= 1
    assert fault["tokens_lost"] == len(missed) * H * 4 * 128 <= rep["tokens_lost"]
    # Bitwise equal at the end, and what the records replayed in one process compute.
    finals = _finals(run_dir)
    assert len({f["sha256"] for f in finals}) == 1 and {f["round"] for f in finals} == {len(rounds)}
    ends = [_outer(run_dir, g) for g in range(3)]
    assert all(np.array_equal(ends[0], e) for e in ends[1:])
    np.testing.assert_allclose(ends[0], _replayed(run_dir, steps), rtol=0, atol=1e-6)


# A study of two faults (most of a minute of three groups' processes on CI's two cores): -m
# experiment. 16 rounds: the lighthouse dies after the eighth at the earliest, and every round
# after it must still commit.
@needs_ft
@pytest.mark.experiment
def test_a_stopped_group_and_a_killed_lighthouse_cost_no_progress(tmp_path):
    run_dir, steps = tmp_path / "run", 64
    proc = _launch(run_dir, steps, "--join-timeout", "2")
    try:
        _wait(lambda: len(_lines(run_dir / "rounds.jsonl")) >= 3, proc)
        stopped_pid = _pids(run_dir, 1)[0]
        os.kill(stopped_pid, signal.SIGSTOP)
        stopped_at = time.time()
        n = len(_lines(run_dir / "rounds.jsonl"))
        _wait(lambda: len(_lines(run_dir / "rounds.jsonl")) >= n + 3, proc, timeout=60)
        os.kill(stopped_pid, signal.SIGCONT)
        n = len(_lines(run_dir / "rounds.jsonl"))
        _wait(lambda: len(_lines(run_dir / "rounds.jsonl")) >= n + 2, proc, timeout=60)
        killed_at = time.time()
        os.kill(_pids(run_dir, "lighthouse")[0], signal.SIGKILL)
        _end(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    rounds = _lines(run_dir / "rounds.jsonl")
    # The others went on without the stopped group.
    during = [r for r in rounds if r["time"] > stopped_at][:3]
    assert all(r["groups"] == [0, 2] for r in during[1:]), during
    # The lighthouse was started again, and no round was lost to it.
    assert len(_pids(run_dir, "lighthouse")) == 2
    assert [len(_pids(run_dir, g)) for g in range(3)] == [1, 1, 1]
    after = [r for r in rounds if r["time"] > killed_at]
    steps_after = [r["step"] for r in after]
    assert steps_after == list(range(steps_after[0], steps, H)), after
    finals = _finals(run_dir)
    assert len({f["sha256"] for f in finals}) == 1


def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize(
    "mesh, fix",
    [("data=2", "--mesh replica=3,data=2"), ("replica=2,data=2", "--groups 2")],
)
def test_groups_without_a_matching_replica_axis_end_in_one_line(tmp_path, mesh, fix):
    train = [a if a != "replica=3,data=2" else mesh for a in TRAIN]
    done = cli("launch", "--groups", "3", "--", *train, "--run-dir", str(tmp_path / "r"))
    assert fix in _one_line(done)


def test_the_groups_take_the_outer_step_flags_as_numbers_or_auto():
    """A fleet's sync flags reach its groups as the fields hold them: --outer-lr 0.7 a number
    (the field's default is `auto`), --sync-every an integer, no flag the default."""
    _, sync, _, _ = fleet.group_args(
        [*TRAIN, "--outer-lr", "0.7", "--outer-momentum", "0.9", "--run-dir", "x"], 3
    )
    assert (sync.outer_lr, sync.outer_momentum, sync.sync_every) == (0.7, 0.9, H)
    _, sync, _, _ = fleet.group_args([*TRAIN, "--run-dir", "x"], 3)
    assert (sync.outer_lr, sync.outer_momentum) == ("auto", "auto")


def test_groups_without_the_sidecar_end_in_one_line(tmp_path):
    env = {k: v for k, v in CLI_ENV.items() if k != FT_PYTHON_VAR}
    done = subprocess.run(
        [*JAXDIST, "launch", "--groups", "3", "--", *TRAIN, "--run-dir", str(tmp_path / "r")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    line = _one_line(done)
    assert "pip install torch==2.13.0 torchft==0.2.0" in line and FT_PYTHON_VAR in line


class _Exited:
    """A process that has exited with `code` (what the supervisor polls)."""

    def __init__(self, code: int):
        self.returncode = code

    def poll(self) -> int:
        return self.returncode

    def kill(self) -> None:
        raise AssertionError("an exited process is not killed")


def _summary(run_dir: pathlib.Path, group: int, preempted_at) -> None:
    own = run_dir / "groups" / str(group)
    own.mkdir(parents=True, exist_ok=True)
    (own / "summary.json").write_text(json.dumps({"preempted_at": preempted_at}))


def test_a_group_stopped_short_by_a_preemption_notice_restarts_and_heals(tmp_path):
    """A SIGTERM to one group's host (a preemption notice) saves and exits 0 short of the end:
    the fleet restarts that group alone to heal, as it does a killed one, and takes a group
    that exits 0 at its end as done. A fleet stopped by its own signal restarts nothing."""
    groups = [fleet.Group(0, [_Exited(0)]), fleet.Group(1, [_Exited(0)])]
    _summary(tmp_path, 0, 12)
    _summary(tmp_path, 1, None)
    started = []

    def start(group, heal):
        started.append((group.index, heal))
        group.procs = [_Exited(0)]
        _summary(tmp_path, group.index, None)  # the restarted group runs to its end

    fleet._supervise(groups, None, tmp_path, 2, start, [])
    assert started == [(0, True)]
    assert [g.restarts for g in groups] == [1, 0] and not any(g.failed for g in groups)
    (line,) = _lines(tmp_path / "restarts.jsonl")
    assert line["by"] == "group 0"
    assert line["cause"] == "group 0: a signal stopped the run after step 12, short of its end"

    stopped = [fleet.Group(0, [_Exited(0)])]
    _summary(tmp_path, 0, 12)
    fleet._supervise(stopped, None, tmp_path, 2, start, [signal.SIGTERM])
    assert started == [(0, True)] and stopped[0].done and not stopped[0].failed

    spent = [fleet.Group(0, [_Exited(0)], restarts=2)]
    fleet._supervise(spent, None, tmp_path, 2, start, [])
    assert spent[0].failed == 1  # short of its end, no restart left: the fleet fails


@needs_ft
def test_an_unreachable_lighthouse_ends_in_one_line(tmp_path):
    done = cli(
        "launch", "--groups", "3", "--lighthouse", "127.0.0.1:9", "--",
        *TRAIN, "--run-dir", str(tmp_path / "r"),
    )  # fmt: skip
    line = _one_line(done)
    assert "127.0.0.1:9 cannot be reached" in line and "drop --lighthouse" in line


@needs_ft
@pytest.mark.experiment  # three fleets (about 3 minutes each case): -m experiment
@pytest.mark.parametrize("first, delay", [(32, 0), (32, 1), (2, 0)])
def test_a_whole_fleet_restarted_resumes_exactly(tmp_path, first, delay):
    """The fleet stopped after `first` steps and launched again to 48 ends as one run of 48
    steps. With a delay, the round that ended at step 31 is applied after step 32: the first
    run ends before that apply, the second takes it. Stopped at step 2, before the first round
    (H = 4): the second run's outer weights are the first ones, not its groups' trained ones."""
    # A constant learning rate, so 32 steps and then 16 more are 48 steps' schedule.
    flags = ["--schedule", "constant", "--warmup-steps", "4", "--checkpoint-every", "8"]
    flags += ["--sync-delay", str(delay)]

    straight, restarted = tmp_path / "straight", tmp_path / "restarted"
    for run_dir, steps in ((straight, 48), (restarted, first), (restarted, 48)):
        # Every round with all three groups, as the straight run's: the lighthouse waits only
        # for groups whose heartbeats it has, so on a loaded host a group that starts late
        # misses the first rounds of a majority quorum (seen here: rounds 1-3 without group 2).
        cmd = [
            *JAXDIST, "launch", "--groups", "3", "--min-groups", "3", "--processes", "1",
            "--devices-per-process", "2", "--", *TRAIN, *flags, "--steps", str(steps),
            "--run-dir", str(run_dir),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=CLI_ENV, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from checkpoint step {first - 1}" in done.stdout + done.stderr
    for run_dir in (straight, restarted):
        assert all(len(r["groups"]) == 3 for r in _rounds(run_dir)), run_dir.name
    ends = [f["sha256"] for f in _finals(straight) + _finals(restarted)]
    assert len(set(ends)) == 1 and _finals(restarted)[0]["round"] == 48 // H
