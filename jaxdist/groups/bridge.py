"""The JAX process's end of its sidecar (jaxdist.groups.sidecar): started beside it in the
sidecar interpreter, spoken to over a Unix socket in a directory only this user can enter (no
network port: the sidecar's own torchft traffic binds the run's host).

`ft_python()` is where the sidecar interpreter is named; `MISSING` says in one line how to get
one, for the launcher and the tests to say.
"""

import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time
from typing import NamedTuple

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.groups import wire

FT_PYTHON_VAR = "JAXDIST_FT_PYTHON"
FT_PACKAGES = "torch==2.13.0 torchft==0.2.0 numpy"
MISSING = (
    f"--groups runs torchft in a Python 3.11 sidecar: make one (python3.11 -m venv ftenv && "
    f"ftenv/bin/pip install {FT_PACKAGES}) and name it with --ft-python ftenv/bin/python or "
    f"{FT_PYTHON_VAR}"
)
HERE = pathlib.Path(__file__).parent


def ft_python(given: str | None = None) -> str:
    """The sidecar interpreter: `given` (--ft-python), else $JAXDIST_FT_PYTHON; one line naming
    the fix where neither names a file."""
    found = given or os.environ.get(FT_PYTHON_VAR)
    if not found or not pathlib.Path(found).is_file():
        raise ConfigError(MISSING if not found else f"{found} does not exist; {MISSING}")
    return found


class Reply(NamedTuple):
    committed: bool
    participants: list[int]
    quorum: int
    summed: np.ndarray | None  # the participants' changes, summed (float64, joined)
    gathered: list[np.ndarray]  # or, sent as bytes (a sync type), each participant's
    healed: tuple[dict, list] | None  # the peer's state (header, arrays) this group took
    quorum_s: float
    round_s: float
    error: str | None


class Bridge:
    """One sidecar: started at once, connected when first spoken to, one round at a time.

    The sidecar's start (torch's import, the Manager) takes seconds: started before the JAX
    process restores and compiles, and awaited only at its first round, it costs the group's
    start nothing (a restarted group rejoins sooner)."""

    def __init__(self, python: str, group: int, groups: int, rank: int, ranks: int, env: dict):
        self.dir = tempfile.mkdtemp(prefix="jaxdist-ft-")  # mode 0700: this user's alone
        path = os.path.join(self.dir, "sidecar.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        cmd = [
            python, str(HERE / "sidecar.py"), "--socket", path, "--group", str(group),
            "--groups", str(groups), "--rank", str(rank), "--ranks", str(ranks),
            "--host", env["host"], "--store-port", str(env["store_port"]),
            "--lighthouse", env["lighthouse"], "--min-groups", str(env["min_groups"]),
            "--timeout", str(env["timeout"]), "--quorum-retries", str(env["quorum_retries"]),
        ]  # fmt: skip
        child_env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}
        child_env.update(env.get("child_env", {}))
        child_env.setdefault("RUST_LOG", "warn")
        self.python, self.group = python, group
        self.proc = subprocess.Popen(cmd, env=child_env, stdin=subprocess.DEVNULL)
        self.sock: socket.socket | None = None
        self.on_request = None  # the round's snapshot, made when a healing peer needs it

    def _connected(self) -> socket.socket:
        """The sidecar's socket, once it has said it is up (waited for here, the first time)."""
        if self.sock is not None:
            return self.sock
        self.listener.settimeout(0.2)  # to notice a sidecar that ended without connecting
        deadline = time.monotonic() + 120
        try:
            while self.sock is None:
                try:
                    self.sock, _ = self.listener.accept()
                except TimeoutError:
                    if self.proc.poll() is None and time.monotonic() < deadline:
                        continue
                    why = "ended" if self.proc.poll() is not None else "did not start in 120 s"
                    self.proc.kill()
                    raise ConfigError(f"the sidecar ({self.python}) {why}; {MISSING}") from None
        finally:
            self.listener.close()
        self.sock.settimeout(None)
        hello, _ = wire.receive(self.sock)
        if not hello.get("ok"):
            raise ConfigError(f"the torchft sidecar could not start: {hello.get('error')}")
        return self.sock

    def send(self, change: np.ndarray, participating: bool, snapshot, gather: bool) -> None:
        """A round's start: this process's change (float64, joined; with `gather`, the bytes of
        its sync type: jaxdist.groups.streaming.coded), whether it counts (a group that joins
        to heal sends zeros that do not), and the state a healing peer would get: (header,
        arrays) sent now, or a function that makes them, called only if the sidecar asks for
        them while `receive` waits (a peer heals from this group in this round's quorum). The
        sidecar runs the round meanwhile; `receive` waits for its end."""
        header = {"op": "round", "participating": participating, "gather": gather}
        arrays = [change]
        if callable(snapshot):
            self.on_request = snapshot
        else:
            head, data = wire.raw(*snapshot)
            header["snapshot_head"] = head.decode()
            arrays.append(np.frombuffer(data, np.uint8))
        wire.send(self._connected(), header, arrays)

    def receive(self) -> Reply:
        while True:
            reply, arrays = wire.receive(self.sock)
            if reply.get("op") != "snapshot":
                break
            # A peer heals from this group in this round: the state as this round's change
            # left, made now (the round's caller trains no step before its end).
            head, data = wire.raw(*self.on_request())
            answer = {"op": "snapshot", "snapshot_head": head.decode()}
            wire.send(self.sock, answer, [np.frombuffer(data, np.uint8)])
        self.on_request = None
        healed = wire.receive(self.sock) if reply["healed"] else None
        gathered = reply.get("gathered", False)
        return Reply(
            reply["committed"], reply["participants"], reply["quorum"],
            None if gathered else arrays[0], list(arrays) if gathered else [], healed,
            reply["quorum_s"], reply["round_s"], reply["error"],
        )  # fmt: skip

    def close(self) -> None:
        try:
            if self.sock is None:  # never spoken to (the run ended before its first round)
                self.listener.close()
                self.proc.kill()
            else:
                wire.send(self.sock, {"op": "close"})
                self.sock.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
