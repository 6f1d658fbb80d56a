"""The node-local checkpoint tier (jaxdist.checkpoint.local), in one process on 8 fake devices.

The state is a small hand-made pytree over a 2x4 mesh: a float32 matrix sharded on both axes,
a bfloat16 vector on `fsdp`, an int8 matrix on `data`, a replicated float32 vector holding -0.0
and a denormal-sized value, and a replicated int32 step; bitwise equality is checked on bytes.
"""

import errno
import json
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.checkpoint import local
from jaxdist.checkpoint.local import LocalDamaged, LocalTier
from jaxdist.errors import ConfigError

W_SPEC = P("data", "fsdp")


def _state(mesh, w_spec=W_SPEC, shift: float = 0.0):
    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    return {
        "step": put(np.int32(7), P()),
        "w": put(np.sin(np.arange(96, dtype=np.float32) + shift).reshape(8, 12), w_spec),
        "b": put(np.linspace(-2, 2, 12).astype(jnp.bfloat16), P("fsdp")),
        "r": put(np.float32([1.5, -0.0, 3e-38, 7, 1e30]), P()),
        "m": put(np.arange(32, dtype=np.int8).reshape(4, 8) - 16, P(None, "data")),
    }


def _abstract(state):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def _bytes(state) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in state.items()}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "fsdp"))


@pytest.fixture
def tier(tmp_path):
    t = LocalTier(tmp_path / "local", keep=2)
    yield t
    t.close()


def _shard_file(tier: LocalTier, step: int, leaf: str) -> pathlib.Path:
    record = json.loads((tier.folder / str(step) / local.RECORD).read_text())
    entry = next(e for e in record["leaves"] if e["path"] == f"['{leaf}']")
    return tier.folder / str(step) / entry["shards"][0]["file"]


def test_save_then_restore_is_bitwise_with_each_distinct_shard_written_once(tier, mesh):
    state = _state(mesh)
    blocked = tier.save(3, state, {"run": "a"})
    tier.wait()
    assert isinstance(blocked, float) and blocked >= 0
    assert tier.folder.name == "process-0" and tier.steps() == [3]
    # Distinct shards per leaf: w 2x4 = 8, b 4, m 2, r and step 1 each (replicas not copied).
    assert len(list((tier.folder / "3").glob("*.bin"))) == 8 + 4 + 2 + 1 + 1
    record = json.loads((tier.folder / "3" / local.RECORD).read_text())
    assert record["mesh"] == {"data": 2, "fsdp": 4} and record["process_count"] == 1
    r = next(e for e in record["leaves"] if e["path"] == "['r']")
    assert sorted(r["shards"][0]["devices"]) == [d.id for d in jax.devices()]  # one file, 8 copies
    assert tier.read_meta(3) == {"run": "a"}
    restored = tier.restore(3, _abstract(state))
    assert _bytes(restored) == _bytes(state)
    for k, x in restored.items():
        assert x.dtype == state[k].dtype and x.sharding == state[k].sharding, k


def test_older_steps_go_only_after_a_newer_one_commits(tier, mesh, monkeypatch):
    import threading

    for s in (1, 2):
        tier.save(s, _state(mesh, shift=s), {})
    tier.wait()
    writing, release, real = threading.Event(), threading.Event(), local._write_file

    def held(path, data):
        if path.parent.name.startswith("3.tmp-"):
            writing.set()
            assert release.wait(30)
        return real(path, data)

    monkeypatch.setattr(local, "_write_file", held)
    tier.save(3, _state(mesh, shift=3), {})
    assert writing.wait(30)
    assert tier.steps() == [1, 2]  # step 3 is being written: nothing pruned yet, nor listed
    assert [p.name.split(".")[0] for p in tier.folder.glob("*.tmp-*")] == ["3"]
    release.set()
    tier.wait()
    assert tier.steps() == [2, 3]


def test_a_step_saved_again_after_a_rollback_replaces_the_abandoned_timeline(tier, mesh):
    for s in (1, 2, 3):
        tier.save(s, _state(mesh, shift=s), {})
    again = _state(mesh, shift=20.0)
    tier.save(2, again, {})
    tier.wait()
    # Step 3's commit pruned step 1 (keep=2); step 3 belonged to the timeline the run left.
    assert tier.steps() == [2]
    assert _bytes(tier.restore(2, _abstract(again))) == _bytes(again)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_shard_file_is_named_and_left_in_place(tier, mesh, damage):
    state = _state(mesh)
    tier.save(1, state, {})
    tier.wait()
    path = _shard_file(tier, 1, "w")
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        path.write_bytes(raw[:5] + bytes([raw[5] ^ 0x01]) + raw[6:])
    else:
        path.unlink()
    want = {"truncate": "is truncated", "flip": "fails its checksum", "delete": "unreadable"}
    with pytest.raises(LocalDamaged, match=f"{path}.*{want[damage]}|{path.name}"):
        tier.restore(1, _abstract(state))
    assert tier.steps() == [1] and (tier.folder / "1").is_dir()


def test_a_record_whose_fingerprint_differs_is_damaged(tier, mesh):
    state = _state(mesh)
    tier.save(1, state, {})
    tier.wait()
    path = tier.folder / "1" / local.RECORD
    record = json.loads(path.read_text())
    record["fingerprint"][0] += 1.0
    path.write_text(json.dumps(record))
    with pytest.raises(LocalDamaged, match="fingerprint"):
        tier.restore(1, _abstract(state))


def test_a_half_written_step_is_not_listed_and_the_next_tier_removes_it(tier, mesh):
    tier.save(1, _state(mesh), {})
    tier.wait()
    half = tier.folder / "5.tmp-999"
    half.mkdir()
    (half / local.RECORD).write_text("{}")
    assert tier.steps() == [1]
    assert LocalTier(tier.folder.parent).steps() == [1] and not half.exists()


def test_a_record_for_another_layout_is_not_usable(tier, mesh, caplog):
    a, b = _state(mesh), _state(mesh, w_spec=P("fsdp", "data"))
    tier.save(1, a, {})
    tier.save(2, b, {})
    tier.wait()
    assert tier.newest_common(_abstract(b)) == 2
    with caplog.at_level(logging.WARNING, "jaxdist.checkpoint"):
        assert tier.newest_common(_abstract(a)) == 1
    assert "sharded otherwise" in caplog.text
    other_mesh = _state(jax.make_mesh((4, 2), ("data", "fsdp")))
    assert tier.newest_common(_abstract(other_mesh)) is None
    assert "written for mesh {'data': 2, 'fsdp': 4}" in caplog.text
    assert tier.newest_common(_abstract(b), accept=lambda meta: meta.get("run") == "x") is None
    for step in (1, 2):
        path = tier.folder / str(step) / local.RECORD
        path.write_text(json.dumps(json.loads(path.read_text()) | {"process_count": 2}))
    assert tier.newest_common(_abstract(a)) is None
    assert "written by 2 processes, this run has 1" in caplog.text


def test_a_write_error_is_reported_and_never_raised(tier, mesh, monkeypatch, caplog):
    calls = []

    def full(path, data):
        calls.append(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "_write_file", full)
    with caplog.at_level(logging.WARNING, "jaxdist.checkpoint"):
        tier.save(1, _state(mesh), {})
        tier.save(2, _state(mesh), {})  # retried after the first failure: fails again
        tier.wait()
        tier.save(3, _state(mesh), {})  # skipped: 2**(2-1) - 1 = 1 save after two failures
        assert len(calls) == 2
        monkeypatch.setattr(local, "_write_file", local.__dict__["_write_file"])
    assert "could not be written" in caplog.text and "No space left on device" in caplog.text
    assert "skipping the next 1 local saves" in caplog.text
    assert "No space left" in tier.last_error
    assert tier.steps() == [] and not list(tier.folder.glob("*.tmp-*"))
    monkeypatch.undo()
    tier.save(4, _state(mesh), {})
    tier.wait()
    assert tier.steps() == [4]


def test_a_non_finite_state_is_not_committed(tier, mesh, caplog):
    state = _state(mesh)
    state["r"] = state["r"] * jnp.float32(np.nan)
    with caplog.at_level(logging.WARNING, "jaxdist.checkpoint"):
        tier.save(1, state, {})
        tier.wait()
    assert tier.steps() == [] and "NaN/Inf" in caplog.text


def test_a_directory_that_cannot_be_created_is_one_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--local-checkpoint-dir"):
        LocalTier(tmp_path / "file" / "local")


def test_discard_removes_the_process_folder_and_the_emptied_run_folder(tmp_path, mesh):
    given = tmp_path / "shm"  # the user's --local-checkpoint-dir, holding two runs' folders
    ours, other = LocalTier(given / "run-a", keep=2), LocalTier(given / "run-b", keep=2)
    for t in (ours, other):
        t.save(3, _state(mesh), {"k": 1})
        t.close()
    assert ours.steps() == [3]
    ours.discard()
    assert not (given / "run-a").exists() and other.steps() == [3] and given.is_dir()
