"""One process of a replica group that is a job of its own (`jaxdist launch --groups M`): its
rows of each batch, its rounds, its healing and its records. The loop calls `start` once and
`after_step` after every step (jaxdist.train); outside a fleet `open_member` returns None.

The launcher names the group in one environment variable, JAXDIST_GROUP (a JSON object:
`Settings`), beside the train flags of one group (its --mesh without `replica`, its run
directory RUN/groups/G).

A round ends after every H/F steps (F = --sync-fragments, fragment f's rounds in turn:
jaxdist.groups.streaming): the process's change of that fragment since the outer weights goes to
the sidecar (jaxdist.groups.bridge; in float64, or as the bytes of --sync-dtype), the
participants' sum comes back (or their bytes, summed here in float64), and only when the round
commits do the fragment's outer weights and momentum take the Nesterov step. The group's
fragment then becomes the outer weights, committed or not (a round that fails is discarded, its
steps lost); with --sync-delay T the round runs while the group trains T more steps, and the
group then mixes the outer weights with its own (--sync-mix). Its inner optimizer state stays
its own, as in the compiled program. The run's last round with a delay ends with the run: its
outer step is taken, its apply (past the last step) is not.

Healing: a group restarted alone joins at the fleet's next round end with a change of zeros that
does not count, takes a live peer's outer weights, momentum, round, step (its data position:
the batch of a step is fixed by the step), weights and inner optimizer state as the peer sent
its round's change, then the round's outer step as every group takes it and its apply (at once,
or T steps on).

Records (the fleet's run directory RUN): rounds.jsonl, one line per committed round (written by
the lowest participating group: its step, fragment and the step after which it was applied);
heals.jsonl, one line per heal; outer/step-S-rank-P.npz, the outer state after the round that
ended at step S (the lowest participating group saves it) and at step 0 the first (group 0
saves it), the newest KEEP kept: a whole fleet restarted takes the one its groups' checkpoints
reach, each group its own checkpoint, and with a delay takes that round's apply where its
checkpoint came before it; groups that resume at different steps are not reconciled;
groups/G/final.json and outer.npz (its last outer weights).
"""

import dataclasses
import json
import os
import pathlib
import time
from typing import NamedTuple

import jax
import numpy as np

from jaxdist.data import TokenBatches
from jaxdist.groups import outer as host
from jaxdist.groups import streaming
from jaxdist.groups.bridge import Bridge
from jaxdist.layout import SyncConfig

ENV = "JAXDIST_GROUP"
KEEP = 64
"""Rounds whose outer state stays on disk (RUN/outer): a whole fleet restarts from its groups'
checkpoints, which the newest of these must reach back to."""


def _step_of(path: pathlib.Path) -> int:
    return int(path.name.split("-")[1])


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the launcher tells one group's processes (JAXDIST_GROUP, as JSON)."""

    group: int
    groups: int
    run_dir: str  # the fleet's (rounds.jsonl); the group's own is RUN/groups/G
    batch_size: int  # the fleet's batch: each group reads its block of it
    sync: dict  # SyncConfig's fields
    lighthouse: str
    host: str
    store_port: int
    ft_python: str
    min_groups: int = 1
    timeout: float = 10.0  # a collective's (the all-reduce, a heal's transfer)
    quorum_retries: int = 20
    heal: bool = False  # restarted alone: join from a live peer
    child_env: dict = dataclasses.field(default_factory=dict)

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def settings() -> Settings | None:
    raw = os.environ.get(ENV)
    return Settings(**json.loads(raw)) if raw else None


def batches(
    group: int, groups: int, batch_size: int, data, seq_len: int, vocab_size: int, rows: range
) -> TokenBatches:
    """Group `group`'s rows of the fleet's batch (its block of `batch_size` rows, as the
    `replica` axis splits it in one program); `rows`: this process's rows within the block."""
    full = TokenBatches(dataclasses.replace(data, batch_size=batch_size), seq_len, vocab_size)
    block = batch_size // groups
    out = full.for_rows(range(group * block + rows.start, group * block + rows.stop))
    out.global_shape = (block, seq_len + 1)
    return out


def _append(path: pathlib.Path, line: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


class _Round(NamedTuple):
    """A round sent: its fragment, the step after which its change left, the change's pieces'
    shapes (to read the participants' bytes) and when it left."""

    fragment: int
    step: int
    shapes: list
    t0: float


class Member:
    def __init__(self, s: Settings, run_dir: pathlib.Path, console, steps: int):
        self.s, self.run_dir, self.console = s, pathlib.Path(run_dir), console
        self.fleet = pathlib.Path(s.run_dir)
        self.sync = SyncConfig(**s.sync)
        self.H = self.sync.sync_every
        self.rank = jax.process_index()
        self.F, self.T = self.sync.sync_fragments, self.sync.sync_delay
        self.turn = self.H // self.F  # steps between two rounds (of successive fragments)
        self.gather = self.sync.sync_dtype in streaming.GATHERED
        self.steps = steps
        self.places: list = []
        self.inflight: _Round | None = None  # a round sent, its result not yet received
        self.due: tuple[int, int] | None = None  # (step, fragment): whose result to take after
        # Started now, beside the restore and the first compile (jaxdist.groups.bridge).
        self.bridge = Bridge(
            s.ft_python, s.group, s.groups, self.rank, jax.process_count(), dataclasses.asdict(s)
        )
        self.outer: host.OuterState | None = None

    def _say(self, text: str) -> None:
        self.console.print(f"group {self.s.group}: {text}", markup=False, highlight=False)

    def start(self, state, s: int):
        """Before the first step: the outer state (new, or the fleet's saved one where it is
        of this step), where each piece's layers lie (for fragments), and, for a group
        restarted alone, its heal."""
        theta = host.pieces(state.params)
        self.places = streaming.where(state.params, host.shards)
        streaming.check(theta, self.places, self.F)
        saved = self._saved(s)
        self.outer = saved or host.OuterState.first(theta, s // self.turn)
        if s == 0 and self.s.group == 0:  # the first outer weights (every group's): a whole
            self._save_outer(0)  # fleet restarted before its first round resumes from them
        if saved is not None and self.T:
            # A whole fleet restarted at step s: the last round before s ended after step
            # r = last - 1 and was applied after step r + T. Where that is at s or later, its
            # checkpoint holds the weights before the apply; the saved outer state is already
            # that round's, so only its apply is due (as the run that went on would take it).
            r = s // self.turn * self.turn - 1
            if r + self.T >= s:
                self.due = (r + self.T, streaming.ending(self.sync, r))
        if not self.s.heal:
            return state, s
        self._send(state, s - 1, streaming.next_fragment(self.sync, s), participating=False)
        state, following = self._finish(state)
        if following is None:
            self._say("restarted, but no live peer is ahead: it goes on from its own state")
            self.due = None
            return state._replace(params=host.placed(state.params, self.outer.params)), s
        return state, following

    def after_step(self, s: int, state):
        """After step s: a due apply of a round's result (--sync-delay), the round that ends
        here (returns the state, and the step it is at: a group healed from a peer ahead of it
        moves to the peer's)."""
        if self.due is not None and self.due[0] == s:
            if self.inflight is not None:
                state, following = self._finish(state)
                if following is not None:
                    return state, following - 1
            state = self._apply(state)
        f = streaming.ending(self.sync, s)
        if f is None:
            return state, s
        self._send(state, s, f, participating=True)
        if self.T and s < self.steps - 1:
            return state, s  # the round runs while the group trains on
        state, following = self._finish(state)
        if following is not None:  # it missed a quorum: behind the fleet
            return state, following - 1
        if self.T:  # the run's last round: its apply would come after the last step
            self.due = None
            return state, s
        return self._apply(state), s

    def _send(self, state, s: int, f: int, participating: bool) -> None:
        """Fragment f's round, after step s: its change leaves (in the sync type)."""
        theta = host.pieces(state.params)
        change = self.outer.parts(theta, self.places, self.F, f)
        if not participating:
            change = [np.zeros_like(c) for c in change]
        payload = streaming.payload_of(change, self.sync.sync_dtype)
        size = payload.size
        self.inflight = _Round(f, s, [c.shape for c in change], time.monotonic())
        self.due = (s + self.T, f)
        round_ = {"fragment": f, "step": s, "payload": size}
        # Without a delay the group waits for the round's end before its next step, so the
        # state a healing peer gets is made only if one asks (a copy of the whole state to the
        # host, about 5x the weights' bytes, otherwise every round); with a delay the group
        # trains on meanwhile, and it is copied now.
        snapshot = lambda: self._snapshot(state, theta, round_)  # noqa: E731
        snapshot = snapshot() if self.T else snapshot
        self.bridge.send(payload, participating, snapshot, self.gather)

    def _finish(self, state):
        """The round in flight's end: its outer step (or, for a group behind, a peer's state).
        Returns the state and, where it healed, the next step to run (the peer's); else None."""
        r, self.inflight = self.inflight, None
        reply = self.bridge.receive()
        if reply.healed is not None:
            return self._healed(state, reply, r.t0)
        if reply.committed and reply.participants:
            self.outer = self._stepped(self.outer, reply, r.shapes, r.fragment)
            self._record(r, reply)
        else:
            why = reply.error or "too few groups"
            self._say(f"round after step {r.step} not committed ({why}): its steps are lost")
        return state, None

    def _stepped(self, outer, reply, shapes, f: int) -> host.OuterState:
        """`outer` after a committed round of fragment f: the participants' changes summed in
        float64 (by the all-reduce, or here from their bytes) as its gradient."""
        total = reply.summed
        if self.gather:
            total = streaming.summed(reply.gathered, shapes, self.sync.sync_dtype)
        return outer.stepped(total, len(reply.participants), self.sync, self.places, f)

    def _apply(self, state, theta=None):
        """The due fragment's outer weights taken, mixed with the group's own after a delay
        (replica.apply's rule); a round that did not commit leaves them as they were."""
        (_, f), self.due = self.due, None
        theta = host.pieces(state.params) if theta is None else theta
        new = streaming.applied(theta, self.outer.params, self.places, self.sync, f)
        return state._replace(params=host.placed(state.params, new))

    def _healed(self, state, reply, t0: float):
        """The peer's state taken (its weights and inner state as it sent its round's change),
        then the round's outer step as every group takes it, and its apply (now, or T steps
        on). Returns the state and the next step to run (the peer's)."""
        header, arrays = reply.healed
        n_o, n_m, n_p = header["outer"], header["momentum"], header["params"]
        f32 = [np.array(a, np.float32) for a in arrays[: n_o + n_m + n_p]]
        self.outer = host.OuterState(f32[:n_o], f32[n_o : n_o + n_m], header["round"])
        f = header["fragment"]
        if reply.committed and reply.participants:
            shapes = [x.shape for x in self.outer.parts(f32[:n_o], self.places, self.F, f)]
            self.outer = self._stepped(self.outer, reply, shapes, f)
        rest = [np.array(a) for a in arrays[n_o + n_m + n_p :]]
        state = host.placed(state._replace(params=None), rest)._replace(
            params=host.placed(state.params, f32[n_o + n_m :])
        )
        self.due = (header["step"] + self.T, f)
        if not self.T:
            state = self._apply(state, f32[n_o + n_m :])
        s = int(jax.device_get(state.step))
        if self.rank == 0:
            line = {
                "round": self.outer.round, "step": s - 1, "group": self.s.group,
                "from": header["group"], "inner": f"group {header['group']}'s",
                "heal_s": round(time.monotonic() - t0, 3), "time": time.time(),
            }  # fmt: skip
            _append(self.fleet / "heals.jsonl", line)
        self._say(
            f"healed from group {header['group']}: outer weights, momentum, round "
            f"{self.outer.round}, step {s}, its weights and inner optimizer state"
        )
        return state, s

    def _snapshot(self, state, theta, round_: dict) -> tuple[dict, list]:
        """What a healing peer gets from this process (its pieces), and what round it is."""
        inner = host.pieces(state._replace(params=None))
        header = {
            "group": self.s.group, "round": self.outer.round, "outer": len(self.outer.params),
            "momentum": len(self.outer.momentum), "params": len(theta), "inner": len(inner),
            **round_,
        }  # fmt: skip
        return header, [*self.outer.params, *self.outer.momentum, *theta, *inner]

    def _record(self, r: "_Round", reply) -> None:
        if self.s.group != min(reply.participants):
            return
        s, outer = r.step, self.outer
        self._save_outer(s + 1)
        if self.rank == 0:
            line = {
                "round": outer.round, "step": s, "fragment": r.fragment,
                "applied_after": s + self.T, "groups": reply.participants,
                "quorum": reply.quorum, "quorum_s": round(reply.quorum_s, 3),
                "round_s": round(reply.round_s, 3), "time": time.time(),
                "outer_mean": outer.mean(),  # rank 0's pieces: a replay's check, round by round
            }  # fmt: skip
            _append(self.fleet / "rounds.jsonl", line)

    def _save_outer(self, step: int) -> None:
        """This process's pieces of the outer state as of `step` (RUN/outer), whole or absent,
        the newest KEEP kept."""
        outer, where = self.outer, self.fleet / "outer"
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f"step-{step}-rank-{self.rank}.tmp.npz"
        np.savez(tmp, *outer.params, *outer.momentum, round=outer.round, step=step)
        os.replace(tmp, where / f"step-{step}-rank-{self.rank}.npz")
        for old in sorted(where.glob(f"step-*-rank-{self.rank}.npz"), key=_step_of)[:-KEEP]:
            old.unlink(missing_ok=True)

    def _saved(self, s: int) -> host.OuterState | None:
        """A whole fleet restarted at step s (each group from its own checkpoint): the outer
        state of the last round that ended by then, as the lowest live group saved it."""
        if s == 0:
            return None
        last = s // self.turn * self.turn  # the step the last round before s ended at
        path = self.fleet / "outer" / f"step-{last}-rank-{self.rank}.npz"
        if not path.is_file():
            self._say(
                f"no saved outer state of step {last} (the newest {KEEP} rounds "
                "are kept): the outer weights start from this group's own"
            )
            return None
        with np.load(path, allow_pickle=False) as z:
            arrays = [z[f"arr_{i}"] for i in range(len(z.files) - 2)]
            half = len(arrays) // 2
            return host.OuterState(arrays[:half], arrays[half:], int(z["round"]))

    def close(self) -> None:
        self.bridge.close()
        if self.rank == 0 and self.outer is not None:
            final = {
                "group": self.s.group,
                "round": self.outer.round,
                "sha256": self.outer.sha256(),
            }
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "final.json").write_text(json.dumps(final) + "\n")
            np.savez(self.run_dir / "outer.npz", *self.outer.params)


def open_member(run_dir, console, steps: int) -> Member | None:
    """This process's part in a fleet of groups (a run of `steps` steps), or None outside
    one."""
    found = settings()
    return Member(found, run_dir, console, steps) if found else None
