"""When the checkpoint tiers save (jaxdist.checkpoint.tiers), decided by `Tiers` alone: stores
that record what they are given stand in for Orbax and the local disk, so each case runs in
milliseconds; the real stores are checked against the `Tier` protocol they share."""

import io
import types

import jax.numpy as jnp
import pytest
from rich.console import Console

from jaxdist.checkpoint.interval import CheckpointConfig
from jaxdist.checkpoint.local import LocalTier
from jaxdist.checkpoint.store import Checkpointer
from jaxdist.checkpoint.tiers import Stores, Tier, Tiers
from jaxdist.metrics.goodput import Ledger


class Store:
    def __init__(self, blocked_s: float):
        self.blocked_s, self.saved, self.closed = blocked_s, [], False

    def save(self, step, state, meta):
        self.saved.append(step)
        return self.blocked_s

    def steps(self):
        return list(self.saved)

    def read_meta(self, step):
        return {}

    def close(self):
        self.closed = True


class Timer:
    def __init__(self, steps: int = 1000):
        self.step_time_s, self.excluded = None, []
        self.loop = types.SimpleNamespace(steps=steps)  # the run's steps, as LoopConfig's

    def p50(self):
        return self.step_time_s

    def exclude(self, seconds):
        self.excluded.append(seconds)


class Log:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)

    def __iter__(self):
        return iter(self.records)


def _tiers(config: CheckpointConfig, local: bool = True, steps: int = 1000):
    persistent, near = Store(0.5), Store(0.25) if local else None
    timer, log = Timer(steps), Log()
    meta = {"param_shapes": {}}
    console = Console(file=io.StringIO())
    tiers = Tiers(Stores(persistent, near), config, meta, timer, Ledger(), log, console)
    return tiers, persistent, near, timer, log


def _run(tiers, steps: int, stop_at: int | None = None) -> None:
    for s in range(steps):
        tiers.save_if_due(s, jnp.zeros(()), last=s == steps - 1, stopping=s == stop_at)
        if s == stop_at:
            return


def test_the_real_stores_are_tiers(tmp_path):
    checkpointer, local = Checkpointer(tmp_path / "p"), LocalTier(tmp_path / "l")
    try:
        assert isinstance(checkpointer, Tier) and isinstance(local, Tier)
    finally:
        checkpointer.close()
        local.close()


def test_fixed_intervals_one_tier_a_step_the_persistent_first():
    config = CheckpointConfig(every="4", local_dir="unused", local_every="2")
    tiers, persistent, local, timer, log = _tiers(config)
    _run(tiers, 10)
    # The local tier counts from its own last save; a step the persistent tier saves is not
    # saved locally as well. The last step is always saved, to the persistent tier.
    assert persistent.saved == [3, 7, 9] and local.saved == [1, 4, 6, 8]
    assert tiers.saves == [0.5] * 3 and sorted(timer.excluded) == [0.25] * 4 + [0.5] * 3
    saves = [(r["tier"], r["step"], r["blocked_s"]) for r in log if r["event"] == "save"]
    assert saves[:2] == [("local", 1, 0.25), ("persistent", 3, 0.5)]
    assert not any(r["event"] == "checkpoint_interval" for r in log)  # fixed: nothing chosen


def test_a_signal_saves_to_the_persistent_tier_at_once():
    tiers, persistent, local, _, _ = _tiers(CheckpointConfig(every="100", local_dir="x"))
    _run(tiers, 50, stop_at=5)
    assert persistent.saved == [5] and local.saved == []  # local auto: no save only to learn


def _printed(tiers) -> int:
    return tiers.console.file.getvalue().count("persistent checkpoint interval")


def test_auto_saves_first_on_the_cap_once_the_step_time_is_known_and_prints_once():
    # The default MTBF (50,000 h a device): Young-Daly's interval is minutes, the cap 0.3 s.
    config = CheckpointConfig(every="auto", auto_cap_minutes=0.005)
    tiers, persistent, _, timer, log = _tiers(config, local=False)
    persistent.blocked_s = 0.001  # saving every 0.3 s costs 0.3%: the cap holds
    for s in range(3):  # no step time yet: no save, none at step 0 to learn its cost
        tiers.save_if_due(s, jnp.zeros(()), last=False, stopping=False)
    assert persistent.saved == [] and not log.records
    timer.step_time_s = 0.1
    for s in range(3, 9):
        tiers.save_if_due(s, jnp.zeros(()), last=False, stopping=False)
    # The cap's 3 steps were trained by step 2 but timed only at 3: the first save there; then
    # every 3 steps (0.3 s).
    assert persistent.saved == [3, 6] and timer.excluded == [0.001, 0.001]
    chosen = [r for r in log if r["event"] == "checkpoint_interval"]
    assert [(c["tier"], c["step"], c["interval_steps"]) for c in chosen] == [
        ("persistent", 3, 3),
        ("persistent", 6, 3),
    ]
    assert chosen[0]["interval_s"] == 0.3 and chosen[0]["young_daly_s"] > 200
    assert _printed(tiers) == 1  # chosen after every save, printed once
    # Saves of 50 ms (median of the later ones 25.5 ms): the cap would cost 8%, so the interval
    # grows to where saving costs 1%, 2.55 s: more than 2x the last printed, printed again.
    persistent.blocked_s = 0.05
    tiers.save_if_due(9, jnp.zeros(()), last=False, stopping=False)
    chosen = [r for r in log if r["event"] == "checkpoint_interval"]
    assert chosen[-1]["interval_s"] == pytest.approx(2.55) and chosen[-1]["interval_steps"] == 26
    assert _printed(tiers) == 2


def test_an_interval_longer_than_what_is_left_of_the_run_is_logged_not_printed():
    # Every 3 steps (the cap, 0.3 s): said in a run of 1000 steps, not in one of 5, whose
    # only save is its last step's.
    for steps, printed in ((1000, 1), (5, 0)):
        config = CheckpointConfig(every="auto", auto_cap_minutes=0.005)
        tiers, persistent, _, timer, log = _tiers(config, local=False, steps=steps)
        persistent.blocked_s, timer.step_time_s = 0.001, 0.1
        _run(tiers, min(steps, 5))
        assert any(r["event"] == "checkpoint_interval" for r in log)
        assert _printed(tiers) == printed, steps


def test_a_resumed_attempt_takes_the_logged_costs_and_does_not_save_at_once():
    config = CheckpointConfig(every="auto", local_dir="x", auto_cap_minutes=0.005)
    tiers, persistent, local, timer, log = _tiers(config)
    past = [{"event": "save", "tier": "persistent", "step": 7, "blocked_s": 0.5}]
    tiers.resume(7, past)
    tiers.save_if_due(8, jnp.zeros(()), last=False, stopping=False)
    # No step time yet: neither tier saves, the local one (no cost logged) not even to learn it.
    assert persistent.saved == [] and local.saved == [] and not log.records
    timer.step_time_s = 0.1
    for s in range(9, 12):
        tiers.save_if_due(s, jnp.zeros(()), last=False, stopping=False)
    # The persistent interval is chosen from the logged cost at once (0.5 s a save: 50 s, where
    # saving costs 1%); the local tier waits the cap's 3 steps from the restored step.
    chosen = [r for r in log if r["event"] == "checkpoint_interval"]
    assert [(c["tier"], c["step"], c["interval_steps"]) for c in chosen][0] == (
        "persistent",
        9,
        500,
    )
    assert persistent.saved == [] and local.saved == [10]


class Discardable(Store):
    discarded = False

    def discard(self):
        self.discarded = True


@pytest.mark.parametrize("finished", [True, False])
def test_the_local_tier_is_discarded_only_when_the_run_finished(finished):
    # A finished run's last step is in the persistent tier; its local copies (tmpfs: memory)
    # would only be left behind. A stopped run keeps them for its resume.
    near = Discardable(0.25)
    config = CheckpointConfig(every="4", local_dir="unused", local_every="2")
    stores = Stores(Store(0.5), near)
    tiers = Tiers(stores, config, {}, Timer(), Ledger(), Log(), Console(quiet=True))
    tiers.close(finished=finished)
    assert near.closed and near.discarded == finished
