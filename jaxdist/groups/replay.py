"""A fleet's rounds replayed in one process: for each committed round of rounds.jsonl, each
participant's H inner steps from the outer weights (on its own rows, with its own inner
optimizer state), the outer step on the sum of their changes; a heal of heals.jsonl hands the
healed group its peer's inner state, as the fleet did. What the groups ended with must be what
this computes from the records alone (tests/test_groups.py)."""

import json
import pathlib

import jax
import jax.numpy as jnp

from jaxdist.groups import outer as host
from jaxdist.groups import streaming


def read(run_dir) -> tuple[list[dict], list[dict]]:
    """(rounds.jsonl, heals.jsonl) of a fleet's run directory."""

    def lines(name: str) -> list[dict]:
        path = pathlib.Path(run_dir) / name
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    return lines("rounds.jsonl"), lines("heals.jsonl")


def replay(
    jitted, batches_of, rounds: list[dict], heals: list[dict], sync, trace: list | None = None
) -> host.OuterState:
    """The outer state after `rounds` (`batches_of(g)`: group g's TokenBatches): each group's
    steps from its last round on, a fragment's result taken when the fleet took it (at once,
    or --sync-delay steps on, mixed), the change as it travelled (--sync-dtype). `trace`
    collects (round, the record's mean outer weight, the replay's)."""
    first = jitted.init_fn()
    places = streaming.where(first.params, host.shards)
    outer = host.OuterState.first(host.pieces(first.params))
    groups: dict[int, _Group] = {}
    for line in rounds:
        s, f = line["step"], line.get("fragment", 0)
        payloads, shapes = [], []
        for g in line["groups"]:
            # The step donates its input: each group trains on a state of its own.
            group = groups.setdefault(g, _Group(jax.tree.map(jnp.copy, first)))
            group.advance(jitted, batches_of(g), s, outer, places, sync)
            change = outer.parts(host.pieces(group.state.params), places, sync.sync_fragments, f)
            payloads.append(streaming.payload_of(change, sync.sync_dtype))
            shapes = [c.shape for c in change]
        summed = streaming.total(payloads, shapes, sync.sync_dtype)
        outer = outer.stepped(summed, len(line["groups"]), sync, places, f)
        for g in line["groups"]:
            groups[g].due = (s + sync.sync_delay, f)
            if not sync.sync_delay:
                groups[g].take(outer, places, sync)
        if trace is not None:
            trace.append((line["round"], line.get("outer_mean"), outer.mean()))
        for heal in heals:
            if heal["round"] == line["round"]:
                peer = groups[heal["from"]]
                groups[heal["group"]] = _Group(
                    jax.tree.map(jnp.copy, peer.state), peer.at, peer.due
                )
    return outer


class _Group:
    """One group in the replay: its state, the next step it runs, the result it takes when."""

    def __init__(self, state, at: int = 0, due: tuple[int, int] | None = None):
        self.state, self.at, self.due = state, at, due

    def advance(self, jitted, batches, until: int, outer, places, sync) -> None:
        """Steps self.at..until, taking a due result after its step."""
        for s in range(self.at, until + 1):
            tokens = jax.make_array_from_process_local_data(
                jitted.batch_sharding, batches.batch(s), batches.global_shape
            )
            self.state, _ = jitted.step_fn(self.state, tokens, None)
            if self.due is not None and self.due[0] == s:
                self.take(outer, places, sync)
        self.at = until + 1

    def take(self, outer, places, sync) -> None:
        (_, f), self.due = self.due, None
        theta = host.pieces(self.state.params)
        new = streaming.applied(theta, outer.params, places, sync, f)
        self.state = self.state._replace(params=host.placed(self.state.params, new))
