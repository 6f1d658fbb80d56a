"""The checkpoint tiers of one attempt and when each saves (stage 5).

A tier is a store the loop saves the train state to (`Tier`): the persistent one (Orbax, the
run directory: jaxdist.checkpoint.store) and, with --local-checkpoint-dir, the node-local one
(jaxdist.checkpoint.local). `Tiers` owns both and their intervals (jaxdist.checkpoint.interval)
and decides after each step which of them is due: the loop makes one call, `save_if_due`, as
torchtitan's checkpointer does (`save(curr_step, last_step)`).
"""

import concurrent.futures
import hashlib
import pathlib
from typing import NamedTuple, Protocol, runtime_checkable

import jax
from rich.console import Console

from jaxdist.checkpoint.interval import CheckpointConfig, Interval, worth_saying
from jaxdist.checkpoint.local import LocalTier
from jaxdist.checkpoint.resume import rerun_hint
from jaxdist.checkpoint.store import Checkpointer, compile_fingerprint
from jaxdist.cluster.faults import Faults
from jaxdist.metrics.goodput import Ledger
from jaxdist.metrics.records import MetricsLog
from jaxdist.metrics.steptimer import StepTimer


@runtime_checkable
class Tier(Protocol):
    """A checkpoint store: `save` starts a save of `state` after `step` with its JSON `meta`
    and returns the seconds the caller was blocked (the rest runs in the background); `steps`
    are those committed, oldest first; `close` waits for the save in flight, then frees the
    store's threads. How a tier restores is its own (the tiers differ in what they prove)."""

    def save(self, step: int, state, meta: dict) -> float: ...

    def steps(self) -> list[int]: ...

    def read_meta(self, step: int) -> dict: ...

    def close(self) -> None: ...


class Stores(NamedTuple):
    """The persistent store and the local tier (None without --local-checkpoint-dir), opened
    before the restore, which reads both; `Tiers` then saves to them."""

    checkpointer: Checkpointer
    local: LocalTier | None

    def close(self) -> None:
        """Waits for the saves in flight to commit (the persistent one raises if it failed)."""
        self.checkpointer.close()
        if self.local is not None:
            self.local.close()


def open_stores(config: CheckpointConfig, run_dir: pathlib.Path, faults: Faults) -> Stores:
    """The run's persistent store and, with --local-checkpoint-dir, its local tier."""
    checkpointer = Checkpointer(run_dir / "checkpoints", config.keep, rerun_hint(run_dir), faults)
    if config.local_dir is None:
        return Stores(checkpointer, None)
    # A folder per run: runs sharing a node's disk never prune each other's checkpoints.
    run = str(run_dir.resolve())
    key = f"{run_dir.resolve().name}-{hashlib.sha1(run.encode()).hexdigest()[:8]}"
    return Stores(checkpointer, LocalTier(pathlib.Path(config.local_dir) / key, keep=2))


class _Scheduled(NamedTuple):
    name: str  # as metrics.jsonl records it: "persistent" or "local"
    store: Tier
    interval: Interval


class Tiers:
    """Both checkpoint tiers of an attempt, their intervals, and the saves they made.

    `save_if_due` saves to at most one tier after a step: the persistent one when its interval
    is due, at the last step and when a signal stops the run; else the local one when its
    interval is due. The loop's time blocked in a save is kept out of the step's time
    (`StepTimer.exclude`) and counted as checkpoint time (the goodput ledger); each save and
    each interval chosen is logged to metrics.jsonl."""

    def __init__(
        self,
        stores: Stores,
        config: CheckpointConfig,
        meta: dict,
        timer: StepTimer,
        ledger: Ledger,
        log: MetricsLog | None,
        console: Console,
    ):
        self.stores, self.meta = stores, meta
        self.checkpointer, self.local = stores
        self.timer, self.ledger, self.log, self.console = timer, ledger, log, console
        n = jax.device_count()
        self._persistent = _Scheduled("persistent", self.checkpointer, Interval(config, n))
        self._local = None
        if self.local is not None:
            self._local = _Scheduled("local", self.local, Interval(config, n, tier="local"))
        self.saves: list[float] = []  # the persistent tier's blocked seconds, for summary.json
        self._shown: dict[str, float] = {}  # per tier, the interval last printed (seconds)
        self._compiling = None  # the fingerprint's compile, beside the loop (`prepare`)

    @property
    def shapes(self) -> dict[str, list[int]]:
        """The parameter shapes every checkpoint of this run is checked against on restore."""
        return self.meta["param_shapes"]

    def resume(self, step: int, past: list[dict]) -> None:
        """A resumed attempt does not save at once to learn the save cost: the earlier attempts
        measured it (`past`: their records), and each interval is chosen from theirs once
        steps are timed."""
        for tier in self._scheduled():
            tier.interval.resume(step, past, tier.name)

    def prepare(self, abstract_state) -> None:
        """Starts compiling what the first save would otherwise compile while the loop waits
        (the state's fingerprint), in a thread beside the first steps."""
        self._compiling = compile_fingerprint(abstract_state)

    def save_if_due(self, step: int, state, *, last: bool, stopping: bool) -> float:
        """Saves after `step` to the tier that is due, if one is; the seconds the loop was
        blocked (0.0: no save). `last`: the run's last step; `stopping`: a signal stops the run
        after this step. Both save to the persistent tier."""
        if stopping or self._due(self._persistent, step) or last:
            return self._save(self._persistent, step, state)
        if self._local is not None and self._due(self._local, step):
            return self._save(self._local, step, state)
        return 0.0

    def newest(self) -> str:
        """The newest committed checkpoint, in words; from a directory listing alone, so that
        a thread may ask while the loop is stuck (Orbax's own lists may be locked)."""
        directory = self.checkpointer.directory
        steps = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())
        return f"checkpoint {steps[-1]}, the newest committed," if steps else "no checkpoint"

    def close(self, finished: bool = False) -> None:
        """Commits the last saves (the attempt's end). `finished`: the run saved its last step
        to the persistent tier, and the local tier is removed: a resume or a longer run
        restores from the persistent one, and a tmpfs tier left behind holds memory."""
        if self._compiling is not None:  # no thread left compiling as the process ends
            concurrent.futures.wait([self._compiling])
        with self.ledger.part("checkpoint"):
            self.stores.close()
        if finished and self.local is not None:
            self.local.discard()

    def _scheduled(self) -> list[_Scheduled]:
        return [self._persistent] + ([self._local] if self._local is not None else [])

    def _due(self, tier: _Scheduled, step: int) -> bool:
        """Whether tier's save is due after step. An auto interval is chosen as soon as a step
        time is known (before any save cost is, as the first save's wait: no save is made at
        step 0 only to learn its cost), and again once a resumed attempt's logged cost is."""
        interval = tier.interval
        if interval.pending():
            self._log_interval(tier.name, step, interval.choose(self.timer.p50()))
        return interval.due(step)

    def _save(self, tier: _Scheduled, step: int, state) -> float:
        # Wait for the step itself first: that wait is step time; the rest is the save's.
        jax.block_until_ready(state)
        with self.ledger.part("checkpoint"):
            blocked = tier.store.save(step, state, self.meta)
        if tier is self._persistent:
            self.saves.append(blocked)
        self.timer.exclude(blocked)  # the device idles while the loop is blocked: reported apart
        if self.log:  # per save, so a run that is killed still leaves its save costs behind
            self.log.write({"event": "save", "tier": tier.name, "step": step, "blocked_s": blocked})
        self._log_interval(tier.name, step, tier.interval.observe(step, blocked, self.timer.p50()))
        return blocked

    def _log_interval(self, tier: str, step: int, chosen: dict | None) -> None:
        """Logs every interval chosen; prints the first that saves before the run ends, then
        only one more than 2x off the last printed (it is chosen again after every save)."""
        if not chosen or not self.log:
            return
        self.log.write({"event": "checkpoint_interval", "tier": tier, "step": step, **chosen})
        shown = self._shown.get(tier)
        if not worth_saying(chosen, step, self.timer.loop.steps):
            return
        if shown is not None and 0.5 <= chosen["interval_s"] / shown <= 2:
            return
        self._shown[tier] = chosen["interval_s"]
        tau = chosen["young_daly_s"]
        why = "Young-Daly" if chosen["interval_s"] >= tau else f"capped; Young-Daly {tau:.0f} s"
        self.console.print(
            f"{tier} checkpoint interval ({why}): every {chosen['interval_steps']} steps = "
            f"{chosen['interval_s']:.1f} s, from save cost {chosen['save_blocked_s'] * 1e3:.0f} "
            f"ms and MTBF {chosen['mtbf_system_s'] / 3600:.1f} h",
            highlight=False,
        )
