"""One process of a replica group that is a job of its own (`jaxdist launch --groups M`): its
rows of each batch, its rounds, its healing and its records. The loop calls `start` once and
`after_step` after every step (jaxdist.train); outside a fleet `open_member` returns None.

The launcher names the group in one environment variable, JAXDIST_GROUP (a JSON object:
`Settings`), beside the train flags of one group (its --mesh without `replica`, its run
directory RUN/groups/G).

A round ends after every H steps: the process's change since the outer weights goes to the
sidecar (jaxdist.groups.bridge), the participants' sum comes back, and only when the round
commits do the outer weights and momentum take the Nesterov step; the group's weights then
become the outer weights, committed or not (a round that fails is discarded, its H steps lost).
Its inner optimizer state stays its own, as in the compiled program.

Healing: a group restarted alone joins at the fleet's next round end with a change of zeros that
does not count, takes a live peer's outer weights, momentum, round, step (its data position:
the batch of a step is fixed by the step) and that peer's inner optimizer state, then the
round's outer step as every group takes it.

Records (the fleet's run directory RUN): rounds.jsonl, one line per committed round (written by
the lowest participating group); heals.jsonl, one line per heal; outer/step-S-rank-P.npz, the
outer state after the round that ended at step S (the lowest participating group saves it, the
newest KEEP rounds kept: a whole fleet restarted takes the one its groups' checkpoints reach,
each group its own checkpoint; groups that resume at different steps are not reconciled);
groups/G/final.json and outer.npz (its last outer weights).
"""

import dataclasses
import json
import os
import pathlib
import time

import jax
import numpy as np

from jaxdist.data import TokenBatches
from jaxdist.groups import outer as host
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


class Member:
    def __init__(self, s: Settings, run_dir: pathlib.Path, console):
        self.s, self.run_dir, self.console = s, pathlib.Path(run_dir), console
        self.fleet = pathlib.Path(s.run_dir)
        self.sync = SyncConfig(**s.sync)
        self.H = self.sync.sync_every
        self.rank = jax.process_index()
        # Started now, beside the restore and the first compile (jaxdist.groups.bridge).
        self.bridge = Bridge(
            s.ft_python, s.group, s.groups, self.rank, jax.process_count(), dataclasses.asdict(s)
        )
        self.outer: host.OuterState | None = None

    def _say(self, text: str) -> None:
        self.console.print(f"group {self.s.group}: {text}", markup=False, highlight=False)

    def start(self, state, s: int):
        """Before the first step: the outer state (new, or the fleet's saved one where it is
        of this step), the sidecar, and, for a group restarted alone, its heal."""
        self.outer = self._saved(s) or host.OuterState.first(host.pieces(state.params), s // self.H)
        if not self.s.heal:
            return state, s
        t0 = time.monotonic()
        theta = host.pieces(state.params)
        zeros = np.zeros_like(self.outer.change(theta))
        reply = self.bridge.round(zeros, False, self._snapshot(state))
        if reply.healed is None:
            self._say("restarted, but no live peer is ahead: it goes on from its own state")
            return state._replace(params=host.placed(state.params, self.outer.params)), s
        return self._healed(state, reply, t0)

    def _healed(self, state, reply, t0: float):
        """The peer's state taken, then the round's outer step as every group takes it.
        Returns the state and the next step to run (the peer's)."""
        header, arrays = reply.healed
        n_o, n_m = header["outer"], header["momentum"]
        f32 = [np.array(a, np.float32) for a in arrays[: n_o + n_m]]
        self.outer = host.OuterState(f32[:n_o], f32[n_o:], header["round"])
        if reply.committed and reply.participants:
            self.outer = self.outer.stepped(reply.summed, len(reply.participants), self.sync)
        inner = host.placed(state._replace(params=None), [np.array(a) for a in arrays[n_o + n_m :]])
        state = inner._replace(params=host.placed(state.params, self.outer.params))
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
            f"{self.outer.round}, step {s} and group {header['group']}'s inner optimizer state"
        )
        return state, s

    def after_step(self, s: int, state):
        """After step s: at a round's end, the round (returns the state, and the step it is
        at: a group healed from a peer ahead of it moves to the peer's)."""
        if (s + 1) % self.H:
            return state, s
        theta = host.pieces(state.params)
        t0 = time.monotonic()
        reply = self.bridge.round(self.outer.change(theta), True, self._snapshot(state))
        if reply.healed is not None:  # it missed a quorum: behind the fleet
            state, following = self._healed(state, reply, t0)
            return state, following - 1
        if reply.committed and reply.participants:
            self.outer = self.outer.stepped(reply.summed, len(reply.participants), self.sync)
            self._record(s, reply)
        else:
            why = reply.error or "too few groups"
            self._say(f"round after step {s} not committed ({why}): its {self.H} steps are lost")
        return state._replace(params=host.placed(state.params, self.outer.params)), s

    def _snapshot(self, state) -> tuple[dict, list]:
        """What a healing peer gets from this process (its pieces)."""
        inner = host.pieces(state._replace(params=None))
        header = {
            "group": self.s.group, "round": self.outer.round, "outer": len(self.outer.params),
            "momentum": len(self.outer.momentum), "inner": len(inner),
        }  # fmt: skip
        return header, [*self.outer.params, *self.outer.momentum, *inner]

    def _record(self, s: int, reply) -> None:
        if self.s.group != min(reply.participants):
            return
        outer, where = self.outer, self.fleet / "outer"
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f"step-{s + 1}-rank-{self.rank}.tmp.npz"
        np.savez(tmp, *outer.params, *outer.momentum, round=outer.round, step=s + 1)
        os.replace(tmp, where / f"step-{s + 1}-rank-{self.rank}.npz")  # whole, or absent
        for old in sorted(where.glob(f"step-*-rank-{self.rank}.npz"), key=_step_of)[:-KEEP]:
            old.unlink(missing_ok=True)
        if self.rank == 0:
            line = {
                "round": outer.round, "step": s, "groups": reply.participants,
                "quorum": reply.quorum, "quorum_s": round(reply.quorum_s, 3),
                "round_s": round(reply.round_s, 3), "time": time.time(),
                "outer_mean": outer.mean(),  # rank 0's pieces: a replay's check, round by round
            }  # fmt: skip
            _append(self.fleet / "rounds.jsonl", line)

    def _saved(self, s: int) -> host.OuterState | None:
        """A whole fleet restarted at step s (each group from its own checkpoint): the outer
        state of the last round that ended by then, as the lowest live group saved it."""
        if s == 0:
            return None
        path = self.fleet / "outer" / f"step-{s // self.H * self.H}-rank-{self.rank}.npz"
        if not path.is_file():
            self._say(
                f"no saved outer state of step {s // self.H * self.H} (the newest {KEEP} rounds "
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


def open_member(run_dir, console) -> Member | None:
    """This process's part in a fleet of groups, or None outside one."""
    found = settings()
    return Member(found, run_dir, console) if found else None
