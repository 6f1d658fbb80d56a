"""Fragments, delay and sync types for groups that are jobs of their own (jaxdist.groups.streaming,
launch --groups): the host's pieces against the compiled program's on the same inputs (its
schedule, fragment, outer step, exchange and delayed apply), then one fleet that uses all three,
a group of it killed and healed, which ends with its groups equal to each other and to a replay
of its records."""

import os
import signal
import subprocess
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.groups import outer as host
from jaxdist.groups import streaming
from jaxdist.layout import SyncConfig
from jaxdist.mesh import build_mesh, parse_mesh
from jaxdist.parallel import exchange, replica, rounds
from tests.extras import needs_ft
from tests.helpers import CLI_ENV, JAXDIST


class _Groups(NamedTuple):
    """What replica.send and replica.apply read of a train state."""

    params: Any
    outer: Any


@pytest.mark.parametrize("H, F, T", [(4, 1, 0), (4, 2, 1), (8, 4, 0), (8, 4, 1), (12, 3, 2)])
def test_a_groups_round_is_the_programs_fragment_and_its_apply_is_t_steps_on(H, F, T):
    sync = SyncConfig(sync_every=H, sync_fragments=F, sync_delay=T)
    for s in range(3 * H):
        f = streaming.ending(sync, s)
        # The program sends a fragment at the step after its round ends (on that step's input:
        # the weights after step s) with a delay, after step s without; it applies T steps on.
        sent = rounds.action(sync, s + 1 if T else s)
        applied = rounds.action(sync, s + T)
        assert (f is not None) == bool(sent and sent.send), (s, f, sent)
        if f is not None:
            assert sent.send == (f,) and applied.apply == (f,), (s, f, sent, applied)
            assert streaming.next_fragment(sync, s - (H // F - 1)) == f


def _mesh():
    return build_mesh(parse_mesh("replica=2"), jax.devices()[:2])


def _leaves(mesh, F: int):
    """A layered weight [4 layers, 8] and one without layers, as the program places them."""
    return {
        "a_layers": replica.leaf((4, 8), ("layers", "embed"), P(), dict(mesh.shape), F),
        "b_plain": replica.leaf((6, 8), ("embed", "mlp"), P(), dict(mesh.shape), F),
    }


def _theta(seed: int):
    rng = np.random.default_rng(seed)
    return {
        "a_layers": rng.standard_normal((4, 8)).astype(np.float32),
        "b_plain": rng.standard_normal((6, 8)).astype(np.float32),
    }


PLACES = [streaming.Piece(0, 0), streaming.Piece(None, 0)]  # as the dict's keys sort


@pytest.mark.parametrize("f", [0, 1])
def test_a_fragments_outer_step_on_the_host_is_the_programs(f):
    mesh, F = _mesh(), 2
    where = _leaves(mesh, F)
    sync = SyncConfig(sync_every=4, sync_fragments=F, outer_lr=0.7, outer_momentum=0.9)
    outer0, mom0 = _theta(0), {k: v / 10 for k, v in _theta(1).items()}
    groups = [_theta(2), _theta(3)]
    owner = {k: NamedSharding(mesh, w.owner) for k, w in where.items()}
    state = _Groups(
        {k: jax.device_put(np.stack([g[k] for g in groups]), NamedSharding(mesh, P("replica")))
         for k in where},
        replica.OuterState(
            {k: jax.device_put(v, owner[k]) for k, v in outer0.items()},
            {k: jax.device_put(v, owner[k]) for k, v in mom0.items()},
        ),
    )  # fmt: skip
    program = jax.jit(lambda s: replica.send(s, (f,), where, sync, mesh))(state).outer

    keys = sorted(where)
    outer = host.OuterState([outer0[k] for k in keys], [mom0[k] for k in keys], 0)
    changes = [outer.change([g[k] for k in keys], PLACES, F, f) for g in groups]
    stepped = outer.stepped(changes[0] + changes[1], 2, sync, PLACES, f)
    for i, k in enumerate(keys):
        np.testing.assert_allclose(stepped.params[i], program.params[k], rtol=0, atol=1e-6)
        np.testing.assert_allclose(stepped.momentum[i], program.momentum[k], rtol=0, atol=1e-6)
    # The other fragment is untouched.
    other = streaming.taken(stepped.params, PLACES, F, 1 - f)
    for a, b in zip(other, streaming.taken(outer.params, PLACES, F, 1 - f), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "float8"])
def test_a_change_in_a_sync_type_sums_to_what_the_program_receives(dtype):
    mesh = _mesh()
    where = _leaves(mesh, 1)
    changes = [_theta(4), _theta(5)]
    keys = sorted(where)
    payloads = [streaming.payload_of([c[k] for k in keys], dtype) for c in changes]
    width = {"bfloat16": 2, "int8": 1, "float8": 1}[dtype]
    scales = 0 if dtype == "bfloat16" else 4 * (4 + 6)  # a float32 per row
    assert payloads[0].nbytes == width * (32 + 48) + scales
    shapes = [changes[0][k].shape for k in keys]
    mean = streaming.summed(payloads, shapes, dtype) / 2
    at = 0
    for k in keys:
        leaf = where[k]
        x_M = jax.device_put(np.stack([c[k] for c in changes]), NamedSharding(mesh, P("replica")))
        program = jax.jit(lambda x, leaf=leaf: exchange.up(x, leaf.spec, leaf.owner, dtype, mesh))
        got = mean[at : at + changes[0][k].size].reshape(changes[0][k].shape)
        np.testing.assert_allclose(got, program(x_M), rtol=0, atol=1e-6)
        at += changes[0][k].size


@pytest.mark.parametrize("f, mix", [(0, 0.5), (1, 0.5), (1, 1.0)])
def test_a_delayed_apply_on_the_host_is_the_programs(f, mix):
    mesh, F = _mesh(), 2
    where = _leaves(mesh, F)
    sync = SyncConfig(sync_every=4, sync_fragments=F, sync_delay=1, sync_mix=mix)
    outer0, groups, keys = _theta(6), [_theta(7), _theta(8)], sorted(where)
    owner = {k: NamedSharding(mesh, w.owner) for k, w in where.items()}
    state = _Groups(
        {k: jax.device_put(np.stack([g[k] for g in groups]), NamedSharding(mesh, P("replica")))
         for k in where},
        replica.OuterState({k: jax.device_put(v, owner[k]) for k, v in outer0.items()}, None),
    )  # fmt: skip
    program = jax.jit(lambda s: replica.apply(s, (f,), where, sync, mesh, mix))(state).params
    for r, g in enumerate(groups):
        got = streaming.applied([g[k] for k in keys], [outer0[k] for k in keys], PLACES, sync, f)
        for i, k in enumerate(keys):
            np.testing.assert_allclose(got[i], program[k][r], rtol=0, atol=1e-6)


def test_a_piece_from_a_later_layer_takes_its_fragments_layers():
    # A pipeline stage holding layers 2..3 of 4, F = 2: fragment 1's layer is its local 1.
    x = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    whole = streaming.taken([x], [streaming.Piece(0, 0)], 2, 1)[0]
    part = streaming.taken([x[1:3]], [streaming.Piece(0, 1)], 2, 1)[0]
    np.testing.assert_array_equal(whole, x[[1, 3]])
    np.testing.assert_array_equal(part, x[[1]])


# --- One fleet with all three ------------------------------------------------------------------

SYNC_FLAGS = ["--sync-fragments", "2", "--sync-delay", "1", "--sync-dtype", "int8"]


@needs_ft
@pytest.mark.experiment  # three groups, a restart, a replay: 45-65 s alone on 2 cores
def test_a_fleet_with_fragments_int8_and_a_delay_heals_ends_equal_and_as_replayed(tmp_path):
    """Group 2 killed mid-run: it heals from a peer (its weights and inner state as the peer
    sent its round's change, then that round's apply a step on), and the groups end bitwise
    equal, and equal to the replay of the records."""
    from tests import test_groups as tg

    run_dir, steps = tmp_path / "run", 48
    proc = _launch(run_dir, steps)
    try:
        tg._wait(lambda: len(tg._lines(run_dir / "rounds.jsonl")) >= 6, proc)
        time.sleep(0.2)  # into the next round's inner steps
        os.kill(tg._pids(run_dir, 2)[0], signal.SIGKILL)
        tg._end(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    records, heals = tg._lines(run_dir / "rounds.jsonl"), tg._lines(run_dir / "heals.jsonl")
    # A round every H/F = 2 steps, fragment 1 first (rounds.action), each applied a step on.
    sync = SyncConfig(sync_every=tg.H, sync_fragments=2, sync_delay=1)
    assert records[-1]["step"] == steps - 1 and len(records) >= steps // 2 - 1
    assert all(r["fragment"] == streaming.ending(sync, r["step"]) for r in records), records
    assert all(r["applied_after"] == r["step"] + 1 for r in records)
    assert [h["group"] for h in heals] == [2] and heals[0]["from"] in (0, 1), heals
    assert records[-1]["groups"] == [0, 1, 2]
    finals = tg._finals(run_dir)
    assert len({f["sha256"] for f in finals}) == 1
    assert {f["round"] for f in finals} == {len(records)}
    ends = [tg._outer(run_dir, g) for g in range(3)]
    assert all(np.array_equal(ends[0], e) for e in ends[1:])
    np.testing.assert_array_equal(ends[0], tg._replayed(run_dir, steps, SYNC_FLAGS))


@needs_ft
@pytest.mark.experiment  # three groups, a stop, a replay: about a minute alone on 2 cores
def test_a_stopped_group_with_a_delay_falls_behind_heals_and_ends_as_replayed(tmp_path):
    """Group 1 stopped (SIGSTOP) while its round is in flight: the others commit rounds
    without it; let go, it finds its round not committed at its apply, heals from a live peer
    (not restarted: its process is the same) and takes part again; the groups end bitwise equal
    and equal to the replay of the records."""
    from tests import test_groups as tg

    run_dir, steps = tmp_path / "run", 48
    proc = _launch(run_dir, steps, "--join-timeout", "2")
    try:
        tg._wait(lambda: len(tg._lines(run_dir / "rounds.jsonl")) >= 4, proc)
        stopped = tg._pids(run_dir, 1)[0]
        os.kill(stopped, signal.SIGSTOP)
        n = len(tg._lines(run_dir / "rounds.jsonl"))
        tg._wait(lambda: len(tg._lines(run_dir / "rounds.jsonl")) >= n + 3, proc, timeout=60)
        os.kill(stopped, signal.SIGCONT)
        tg._end(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    records, heals = tg._lines(run_dir / "rounds.jsonl"), tg._lines(run_dir / "heals.jsonl")
    assert [len(tg._pids(run_dir, g)) for g in range(3)] == [1, 1, 1]  # nothing restarted
    assert any(r["groups"] == [0, 2] for r in records), records
    # Group 1 healed from a live peer (on a loaded host a group late to its first rounds
    # heals too: that is the same path).
    assert any(h["group"] == 1 and h["from"] in (0, 2) for h in heals), heals
    assert all(h["from"] != h["group"] for h in heals), heals
    assert records[-1]["step"] == steps - 1 and records[-1]["groups"] == [0, 1, 2]
    assert all(r["applied_after"] == r["step"] + 1 for r in records)
    finals = tg._finals(run_dir)
    assert len({f["sha256"] for f in finals}) == 1
    ends = [tg._outer(run_dir, g) for g in range(3)]
    assert all(np.array_equal(ends[0], e) for e in ends[1:])
    np.testing.assert_array_equal(ends[0], tg._replayed(run_dir, steps, SYNC_FLAGS))


def _launch(run_dir, steps: int, *extra: str) -> subprocess.Popen:
    from tests import test_groups as tg

    cmd = [
        *JAXDIST, "launch", "--groups", "3", "--processes", "1", "--devices-per-process", "2",
        "--max-restarts", "1", "--heartbeat-timeout", str(tg.HEARTBEAT_S), *extra, "--",
        *tg.TRAIN, *SYNC_FLAGS, "--steps", str(steps), "--run-dir", str(run_dir),
    ]  # fmt: skip
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=CLI_ENV)


def test_the_groups_take_the_streaming_flags():
    from jaxdist.groups import fleet
    from tests import test_groups as tg

    _, sync, _, _ = fleet.group_args([*tg.TRAIN, *SYNC_FLAGS, "--run-dir", "x"], 3)
    assert (sync.sync_fragments, sync.sync_delay, sync.sync_dtype) == (2, 1, "int8")
