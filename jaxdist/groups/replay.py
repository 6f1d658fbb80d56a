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


def read(run_dir) -> tuple[list[dict], list[dict]]:
    """(rounds.jsonl, heals.jsonl) of a fleet's run directory."""

    def lines(name: str) -> list[dict]:
        path = pathlib.Path(run_dir) / name
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    return lines("rounds.jsonl"), lines("heals.jsonl")


def replay(
    jitted, batches_of, rounds: list[dict], heals: list[dict], sync, trace: list | None = None
) -> host.OuterState:
    """The outer state after `rounds` (`batches_of(g)`: group g's TokenBatches). `trace`
    collects (round, the record's mean outer weight, the replay's)."""
    H, first = sync.sync_every, jitted.init_fn()
    outer = host.OuterState.first(host.pieces(first.params))
    states: dict[int, object] = {}
    for line in rounds:
        summed = None
        for g in line["groups"]:
            # The step donates its input: each group trains on a state of its own.
            state = states.get(g) or jax.tree.map(jnp.copy, first)
            state = state._replace(params=host.placed(state.params, outer.params))
            batches = batches_of(g)
            for s in range(line["step"] - H + 1, line["step"] + 1):
                tokens = jax.make_array_from_process_local_data(
                    jitted.batch_sharding, batches.batch(s), batches.global_shape
                )
                state, _ = jitted.step_fn(state, tokens, None)
            change = outer.change(host.pieces(state.params))
            summed = change if summed is None else summed + change
            states[g] = state
        outer = outer.stepped(summed, len(line["groups"]), sync)
        if trace is not None:
            trace.append((line["round"], line.get("outer_mean"), outer.mean()))
        for heal in heals:
            if heal["round"] == line["round"]:
                states[heal["group"]] = jax.tree.map(jnp.copy, states[heal["from"]])
    return outer
