"""The replica groups' outer rounds as a run reports them (jaxdist.parallel.replica: groups
that train alone and meet every H steps): which step ran one, what it cost and what it sent.

A round is the exchange and outer update of the fragments a step sends (rounds.action's
`send`; with --sync-delay T the groups take the result T steps later). It runs inside that
step's program, compiled apart from the plain step's: its cost is the step's time above the
median plain step (`seconds`, what the outer step adds where nothing hides it), its bytes one
device's, as planning.sync prices them for `plan` (the all-to-all up and the all-gather back,
full buffers, in the sync type with its scales). Each round is one record in metrics.jsonl
({"event": "round", ...}), a mark on its step's line, and the summary's row; `never_meet` warns
of a run too short for its groups to meet at all.
"""

import numpy as np

from jaxdist.layout import SyncConfig
from jaxdist.metrics.records import distribution
from jaxdist.parallel import rounds
from jaxdist.planning import sync as sync_price


def first_round(sync: SyncConfig) -> int:
    """The first step (0-based) that runs an outer round's exchange."""
    s = 0
    while not (rounds.action(sync, s) or rounds.Action()).send:
        s += 1  # within H + T steps: every fragment sends once per H
    return s


def never_meet(sync: SyncConfig | None, replicas: int, steps: int) -> str | None:
    """A warning for a run whose groups never meet (no step of 0..steps-1 runs a round): what
    eval and export read, the outer weights, would stay the first ones. None: they meet."""
    if sync is None or replicas < 2:
        return None
    first = first_round(sync)
    if first < steps:
        return None
    plain = sync.sync_fragments == 1 and sync.sync_delay == 0  # the first round ends step H - 1
    fewer = f"--sync-every {steps} or less" if plain else "a smaller --sync-every"
    return (
        f"the {replicas} replica groups first meet after step {first} (--sync-every "
        f"{sync.sync_every}), but the run ends after step {steps - 1}: they never meet, and "
        f"the outer weights (what eval and export read) stay the first ones; pass --steps "
        f"{first + 1} or more, or {fewer}"
    )


class Rounds:
    """The rounds of one attempt, fed step by step by the step timer (`step`)."""

    def __init__(self, jitted, past: list[dict], start: int):
        layout = jitted.layout
        self.sync = layout.sync if layout.grouped else None
        # Rounds of earlier attempts, for the count (a resume numbers on).
        self.before = sum(1 for r in past if r.get("event") == "round" and r["step"] < start)
        self.fragment_bytes: list[float] = []
        if self.sync is not None:
            messages = sync_price.exchange_messages(jitted.abstract_params, layout)
            self.fragment_bytes = [sum(sum(v) for v in m.values()) for m in messages]
        self.plain: list[float] = []  # steady plain steps' times
        self.timed_s = 0.0  # every steady step's time, rounds included
        self.records: list[dict] = []

    def step(self, s: int, act, dt: float, steady: bool, compile_s: float) -> dict | None:
        """Step s (which ran `act`, rounds.action's) finished in dt seconds: its round's record,
        or None (no round). `steady`: its time is a step's alone (no compile, no trace)."""
        sent = act.send if act is not None else ()
        if steady:
            self.timed_s += dt
            if not sent:
                self.plain.append(dt)
        if not sent:
            return None
        median = float(np.median(self.plain[-100:])) if self.plain else None
        rec = {
            "event": "round",
            "round": self.before + len(self.records) + 1,
            "step": s,
            "fragments": list(sent),
            # The outer step's own time: what the step took above a plain one (unknown before
            # a steady plain step, or where this step's time is not its own).
            "seconds": max(0.0, dt - median) if median is not None and steady else None,
            "step_time_s": dt,
            "bytes": sum(self.fragment_bytes[f] for f in sent),
        }
        if compile_s:
            rec["compile_s"] = compile_s  # its program compiled before it ran (not in its time)
        self.records.append(rec)
        return rec

    def summary(self, steps: int) -> dict | None:
        """summary.json's `rounds`: this attempt's count, sizes and time share."""
        if self.sync is None:
            return None
        recs = self.records
        timed = [r["seconds"] for r in recs if r["seconds"] is not None]
        last = recs[-1]["step"] if recs else None
        return {
            "count": len(recs),
            "every_steps": self.sync.sync_every,
            "fragments": self.sync.sync_fragments,
            "bytes_per_round": float(np.mean([r["bytes"] for r in recs])) if recs else None,
            "seconds": distribution(timed),
            "outer_share": sum(timed) / self.timed_s if timed and self.timed_s else None,
            "last_step": last,
            # Steps after it live in the groups' own weights only: eval and export miss them.
            "steps_after_last": steps - 1 - last if last is not None else None,
        }


def mark(rec: dict) -> str:
    """A round's mark on its step's line: the groups met, what it added, what it sent."""
    cost = f", outer step +{rec['seconds'] * 1e3:.1f} ms" if rec["seconds"] is not None else ""
    text = f"| round {rec['round']}: groups met{cost}, {rec['bytes'] / 1e6:.3f} MB sent per device"
    if rec.get("compile_s"):
        text += f" (its program compiled first: {rec['compile_s']:.1f} s, not in step time)"
    return text
