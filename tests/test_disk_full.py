"""A full disk and a run directory in use: what the trainer says, and what it leaves behind.

The disk is real: a tmpfs just big enough for two checkpoints of the tiny model (mounting needs
root; elsewhere those tests skip and say so). The lock is tested directly, in this process and
against another process that holds it and is killed with SIGKILL.

A run that must show what a user sees on its stderr (the full disk's warnings go through
logging, which pytest captures in this process), or must hold the lock while another trainer
tries it, is a process of its own; the other commands run here, main() read by capsys, on the
8 fake devices tests/conftest.py started and with its compile cache left as it is.
"""

import errno
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

import jax.numpy as jnp
import pytest

from jaxdist.checkpoint.lock import RunLock
from jaxdist.checkpoint.store import Checkpointer
from jaxdist.checkpoint.writefail import CheckpointWriteFailed, QuietWriteErrors, write_errno
from jaxdist.cli.main import main
from jaxdist.errors import ConfigError
from jaxdist.metrics.records import read_metrics
from tests.helpers import cli, cli_popen, losses, tiny_train

MB = 1_000_000
# A checkpoint of the tiny model (with Adam's two moments) is ~5.3 MB: 13.5 MB holds two of
# them and not a third, and before the second save less than two are free (the warning).
ROOM = 13_500_000
FS_SIZE = "40m"  # with the filler removed, room for the four checkpoints of an 8-step run
STEPS = 8  # saves at steps 1, 3, 5, 7


def _mount_tmpfs(where: pathlib.Path, size: str) -> str | None:
    """Mounts a tmpfs; the reason it cannot, or None."""
    if os.geteuid() != 0:
        return "mounting a small file system needs root (CI runs these tests as root)"
    where.mkdir()
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        return f"mount -t tmpfs is not permitted here ({p.stderr.strip() or p.returncode})"
    return None


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs with ROOM bytes free (a filler file holds the rest); yields (mount, filler)."""
    mnt = tmp_path / "disk"
    why = _mount_tmpfs(mnt, FS_SIZE)
    if why:
        pytest.skip(why)
    try:
        filler = mnt / "filler"
        with filler.open("wb") as f:
            f.write(b"\0" * (os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize - ROOM))
        yield mnt, filler
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _train(run_dir: pathlib.Path) -> list[str]:
    args = [*tiny_train(STEPS, checkpoint_every=2), "--devices", "cpu:8"]
    return [*args, "--checkpoint-keep", "100", "--run-dir", str(run_dir)]


def _here(capsys, *args: str) -> tuple[int, str, str]:
    """`jaxdist *args` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main([*args, *(["--compile-cache", "off"] if args[0] == "train" else [])])
    out, err = capsys.readouterr()
    return rc, out, err


def _checkpoints(capsys, run_dir: pathlib.Path) -> list[dict]:
    rc, out, err = _here(capsys, "checkpoints", str(run_dir), "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_full_disk_stops_with_one_message_and_a_rerun_resumes(small_disk, capsys):
    mnt, filler = small_disk
    run_dir = mnt / "run"
    ckpt_dir = run_dir / "checkpoints"
    p = cli(*_train(run_dir))  # a process: its stderr is what the user reads
    rows = _checkpoints(capsys, run_dir)
    sizes = [r["bytes"] for r in rows]
    assert sizes and all(ROOM / 3 < b < ROOM / 2 for b in sizes), (
        f"checkpoints of {sizes} bytes: ROOM={ROOM} no longer holds exactly two; retune it"
    )
    assert p.returncode == 1, p.stderr
    err = p.stderr
    assert "Traceback" not in err + p.stdout and "ERROR:absl" not in err, err
    # Warned while there was still room, before the save that did not fit.
    assert "room for one more checkpoint" in err and "--checkpoint-keep 100" in err, err
    stopped = [line for line in err.splitlines() if line.startswith("jaxdist: stopped:")]
    assert len(stopped) == 1, err
    msg = stopped[0]
    assert f"checkpoint step 5 could not be written to {ckpt_dir}: no space left" in msg
    assert "MB free there now, a checkpoint needs about 5." in msg  # free and needed
    assert "checkpoints 1, 3 are intact; a rerun resumes from checkpoint 3" in msg
    assert "Free at least" in msg and "lower --checkpoint-keep" in msg  # the way out
    assert not list(ckpt_dir.glob("*.orbax-checkpoint-tmp*"))  # partial write removed
    assert [(r["name"], r["valid"]) for r in rows] == [("1", True), ("3", True)]

    filler.unlink()  # the user frees space
    rc, _, err = _here(capsys, *_train(run_dir))  # in this process a traceback fails the test
    assert rc == 0, err
    assert "resuming from checkpoint step 3" in err and "Traceback" not in err
    rows = _checkpoints(capsys, run_dir)
    assert [(r["name"], r["valid"]) for r in rows] == [(str(s), True) for s in (1, 3, 5, 7)]
    assert sorted(losses(run_dir)) == list(range(STEPS))


def _state():
    return {"w": jnp.arange(1024, dtype=jnp.float32), "step": jnp.int32(3)}


@pytest.mark.parametrize(
    "code, says",
    [(errno.ENOSPC, "no space left on device ("), (errno.EIO, "input/output error (")],
)
def test_a_save_refused_at_once_by_the_file_system_stops_cleanly(tmp_path, code, says):
    ck = Checkpointer(tmp_path, keep=2)
    ck.save(1, _state(), {"mesh": {}})
    ck.wait()
    (tmp_path / "3.orbax-checkpoint-tmp").mkdir()  # what a write cut short leaves
    refused = OSError(code, os.strerror(code), str(tmp_path / "3"))
    with (
        mock.patch.object(ck._manager, "save", side_effect=refused),
        pytest.raises(CheckpointWriteFailed) as e,
    ):
        ck.save(3, _state(), {"mesh": {}})
    msg = str(e.value)
    assert f"checkpoint step 3 could not be written to {tmp_path}: {says}" in msg
    assert "checkpoint 1 is intact; a rerun resumes from checkpoint 1" in msg
    assert ("Free " in msg) == (code == errno.ENOSPC)  # the way out fits the cause
    assert not (tmp_path / "3.orbax-checkpoint-tmp").exists() and ck.steps() == [1]
    with pytest.raises(CheckpointWriteFailed):  # the run cannot go on saving
        ck.close()


def test_write_errors_are_recognised_and_only_theirs_are_silenced():
    ts = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database: Failed to write 1289424 '
        "bytes to file 5: No space left on device [os_error_code='28']"
    )
    assert write_errno(ts) == errno.ENOSPC
    wrapped = RuntimeError("commit failed")
    wrapped.__cause__ = ts
    assert write_errno(wrapped) == errno.ENOSPC
    assert write_errno(OSError(errno.EDQUOT, "quota")) == errno.EDQUOT
    assert write_errno(TypeError("a bug")) is None

    def record(msg, exc, path="/site-packages/orbax/checkpoint/x.py"):
        info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("absl", logging.ERROR, path, 1, msg, (), info)

    quiet = QuietWriteErrors()
    assert not quiet.filter(record("Save Finalize thread failed.", ts))
    assert not quiet.filter(record(f"raised an exception: {ts}", None))
    assert quiet.filter(record("Save Finalize thread failed.", TypeError("a bug")))
    assert quiet.filter(record(f"raised an exception: {ts}", None, path="/elsewhere.py"))
    # asyncio's report of an Orbax writer task that ended on the full disk after the save was
    # abandoned (seen under load); other asyncio errors still show.
    task = logging.LogRecord(
        "asyncio", logging.ERROR, "/lib/asyncio/base_events.py", 1, f"task: {ts!r}", (), None
    )
    assert not quiet.filter(task)
    task.msg = "task: ValueError('a bug')"
    assert quiet.filter(task)


LATE = (
    "import asyncio, sys, threading\n"
    "import tensorstore as ts\n"
    "from jaxdist.checkpoint.writefail import quiet_late_writer_callbacks\n"
    "quiet_late_writer_callbacks()\n"
    "promise, future = ts.Promise.new()\n"
    "loop = asyncio.new_event_loop()\n"
    "async def write():\n"
    "    await future\n"
    "loop.create_task(write())\n"
    "loop.run_until_complete(asyncio.sleep(0.01))\n"
    "loop.close()  # as Orbax's loop, once a save's first write failed\n"
    "done = threading.Thread(target=promise.set_result, args=(1,))\n"
    "done.start(); done.join()  # a write ending later, on TensorStore's thread\n"
    "class Other:\n"
    "    def __del__(self):\n"
    "        raise RuntimeError('Event loop is closed')  # not a writer's callback: shown\n"
    "Other()\n"
)


def test_a_write_ending_after_its_save_was_abandoned_prints_nothing():
    p = subprocess.run([sys.executable, "-c", LATE], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "call_soon_threadsafe" not in p.stderr, p.stderr
    assert p.stderr.count("Event loop is closed") == 1 and "__del__" in p.stderr, p.stderr


# --- one writer per run directory ---

HOLD = (
    "import sys, time\n"
    "from jaxdist.checkpoint.lock import RunLock\n"
    "with RunLock(sys.argv[1], 0):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(300)\n"
)


def test_second_lock_is_refused_naming_the_holder_and_released_on_exit(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError), RunLock(run_dir, 0):
        with pytest.raises(ConfigError) as e, RunLock(run_dir, 0):
            pass
        msg = str(e.value)
        assert f"run directory {run_dir} is in use by another trainer" in msg
        assert f"process {os.getpid()} on host {socket.gethostname()}, since " in msg
        assert time.strftime("%Y-%m-%d") in msg  # the start, in local time
        assert "wait for it to finish" in msg and "another --run-dir" in msg
        with RunLock(run_dir, 1):  # the job's other processes take nothing
            pass
        raise RuntimeError("the run fails")
    with RunLock(run_dir, 0):  # released by the exception
        pass
    assert (run_dir / ".lock").read_text() == ""  # no stale holder left on a clean exit


def test_other_processes_of_a_job_take_no_lock(tmp_path):
    with RunLock(tmp_path / "run", 3):
        assert not (tmp_path / "run").exists()


def test_a_holder_killed_with_sigkill_does_not_block_the_next_run(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError) as e, RunLock(run_dir, 0):
            pass
        assert f"process {holder.pid} on host {socket.gethostname()}" in str(e.value)
        assert f"kill {holder.pid}" in str(e.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((run_dir / ".lock").read_text())["pid"] == holder.pid  # it left its record
    with RunLock(run_dir, 0):
        assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()


def test_a_free_lock_left_by_another_host_is_taken_over_with_a_warning(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = {"host": "node-17", "pid": 4242, "since": time.time() - 3600}
    (run_dir / ".lock").write_text(json.dumps(stale))
    with caplog.at_level(logging.WARNING, "jaxdist.checkpoint"), RunLock(run_dir, 0):
        pass
    assert "process 4242 on host node-17" in caplog.text and "taking it over" in caplog.text


@pytest.mark.slow
def test_second_trainer_is_refused_while_the_first_runs(tmp_path, capsys):
    """End to end, once train.fit holds RunLock: a second `jaxdist train` on a run directory
    in use exits 2 naming the first; after the first is killed with SIGKILL, a third runs.
    The first is another process; the second and third run in this one."""
    run_dir = tmp_path / "run"
    common = ["--devices", "cpu:8", "--run-dir", str(run_dir)]
    # 500 steps keep it running; --decay-steps 21 gives it the learning-rate schedule, and so
    # the step program (compiled once for the session), of the short tiny runs (<= 21 steps).
    first = cli_popen(
        *tiny_train(500, checkpoint_every=1000), "--decay-steps", "21", *common, merge_output=False
    )
    try:
        end = time.monotonic() + 120
        while not read_metrics(run_dir / "metrics.jsonl") and time.monotonic() < end:
            assert first.poll() is None, first.communicate()[1]
            time.sleep(0.1)
        rc, _, err = _here(capsys, *tiny_train(2, checkpoint_every=1000), *common)
        assert rc == 2, err
        assert f"run directory {run_dir} is in use by another trainer" in err
        assert f"process {first.pid} on host {socket.gethostname()}" in err
        assert first.poll() is None  # the first was left alone
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    rc, _, err = _here(capsys, *tiny_train(2, checkpoint_every=1000), *common)
    assert rc == 0, err
