"""`jaxdist launch --groups M`: a lighthouse and M replica groups on this host, each group its
own `jax.distributed` job of `--processes` processes running the train command with the same
per-group mesh (the train flags' --mesh without its `replica=M`), each restarted alone when one
of its processes fails or a signal that is not the launcher's (a preemption notice) stops it
short of its end (up to --max-restarts times per group), the lighthouse started again on its
address when it dies. The groups meet every H steps through torchft in a sidecar
(jaxdist.groups.member).

The run directory RUN gets launch.jsonl (one line per process started: group, process, pid,
start) and restarts.jsonl (one line per restart, `by` "group G" or "lighthouse"); each group
trains in RUN/groups/G.

The groups share the train command's persistent compile cache (--compile-cache, by default the
user's, kept across runs): a group restarted alone loads the programs its peers compiled rather
than compiling them again, and a fleet launched again compiles nothing. No cache of the run's
own is set: one would start cold for every fleet.
"""

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from jaxdist.cluster import restarts
from jaxdist.cluster.launch import _start, _stream, free_port, stopped_short
from jaxdist.cluster.manifests import split_run_dir
from jaxdist.errors import ConfigError
from jaxdist.groups.bridge import FT_PACKAGES, HERE, MISSING, ft_python
from jaxdist.groups.member import ENV, Settings
from jaxdist.layout import SyncConfig

_SYNC_FLAGS = {"--" + f.name.replace("_", "-"): f for f in dataclasses.fields(SyncConfig)}


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """How the groups find each other and how long they wait (jaxdist launch's flags)."""

    groups: int
    ft_python: str | None = None
    host: str = "127.0.0.1"  # every listening socket of the run binds this address
    lighthouse: str | None = None  # HOST:PORT of a running lighthouse; None: launch starts one
    min_groups: int | None = None  # None: a majority of the groups
    heartbeat_timeout: float = 3.0
    join_timeout: float = 10.0
    collective_timeout: float = 10.0


def _take_flag(args: list[str], flag: str) -> tuple[list[str], str | None]:
    rest, value, i = [], None, 0
    while i < len(args):
        if args[i] == flag and i + 1 < len(args):
            value, i = args[i + 1], i + 2
            continue
        if args[i].startswith(flag + "="):
            value = args[i].partition("=")[2]
        else:
            rest.append(args[i])
        i += 1
    return rest, value


def _value(text: str, default):
    """A sync flag's value as its field holds it: the default's type, a number where the
    default is `auto` (--outer-lr 0.7), else the text (auto, a dtype's name)."""
    kinds = (type(default),) if not isinstance(default, str) else (int, float)
    for kind in kinds:
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def group_args(train_args: list[str], groups: int) -> tuple[list[str], SyncConfig, int, str]:
    """One group's train arguments (--mesh without `replica`, no sync flags, its share of the
    batch, no run directory yet), the sync settings, the fleet's batch and run directory; bad
    settings end here in one line."""
    args, run_dir = split_run_dir(train_args)
    if run_dir is None:
        raise ConfigError("--groups keeps each group's records and checkpoints: give --run-dir DIR")
    args, mesh = _take_flag(args, "--mesh")
    axes = [p.strip() for p in (mesh or "").split(",") if p.strip()]
    replica = [a for a in axes if a.startswith("replica=")]
    if not replica:
        raise ConfigError(
            f"--groups {groups} needs a replica axis in the train command's --mesh (each group "
            f"the rest of it): --mesh replica={groups},data=2"
        )
    if replica[0] != f"replica={groups}":
        raise ConfigError(
            f"--groups {groups} and --mesh {mesh} disagree: the replica axis is the groups, "
            f"write --mesh replica={groups},... or --groups {replica[0].partition('=')[2]}"
        )
    inner = ",".join(a for a in axes if not a.startswith("replica=")) or "data=1"
    fields = {}
    for flag, field in _SYNC_FLAGS.items():
        args, value = _take_flag(args, flag)
        if value is not None:
            fields[field.name] = _value(value, field.default)
    sync = SyncConfig(**fields)
    sync.validate(groups)
    args, batch = _take_flag(args, "--batch-size")
    batch_size = int(batch) if batch else 16
    if batch_size % groups:
        raise ConfigError(f"--batch-size {batch_size} must divide among {groups} groups")
    return (
        [*args, "--mesh", inner, "--batch-size", str(batch_size // groups)],
        sync,
        batch_size,
        run_dir,
    )


def check_lighthouse(address: str, timeout: float = 3.0) -> None:
    host, _, port = address.removeprefix("http://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"the lighthouse at {address} cannot be reached ({e}): start it (torchft_lighthouse "
            "--bind HOST:PORT --min_replicas N) or drop --lighthouse to let launch start one"
        ) from None


def check_sidecar(python: str) -> None:
    found = subprocess.run(
        [python, "-c", "import torch, torchft"], capture_output=True, text=True, timeout=120
    )
    if found.returncode:
        raise ConfigError(f"{python} lacks torch or torchft (pip install {FT_PACKAGES}); {MISSING}")


class Plan(NamedTuple):
    """One group's train arguments and the fleet's settings, checked."""

    args: list[str]  # one group's: --mesh without replica, its share of the batch, no run dir
    run_dir: str
    settings: Settings  # the fleet's; where it runs (this host, a cluster) fills in the rest


def plan(fc: FleetConfig, train_args: list[str], find_python: Callable[[], str]) -> Plan:
    """The fleet's checks (groups, mesh, sync flags, batch, run directory), each a one-line
    ConfigError naming the fix, the train command's first, then the sidecar interpreter
    (`find_python`'s): what this host's launcher and the cluster's launch files both check."""
    if fc.groups < 1:
        raise ConfigError(f"--groups {fc.groups} must be at least 1")
    args, sync, batch_size, run_dir = group_args(train_args, fc.groups)
    python = find_python()
    settings = Settings(
        group=0, groups=fc.groups, run_dir=run_dir, batch_size=batch_size,
        sync=dataclasses.asdict(sync), lighthouse=fc.lighthouse or "", host="", store_port=0,
        ft_python=python, min_groups=fc.min_groups or fc.groups // 2 + 1,
        timeout=fc.collective_timeout,
    )  # fmt: skip
    return Plan(args, run_dir, settings)


def check_restarts(max_restarts: int) -> None:
    if max_restarts < 0:
        raise ConfigError(
            f"--max-restarts {max_restarts} is negative; pass 0 (no restarts) or more"
        )


def lighthouse_args(fc: FleetConfig, min_groups: int) -> list[str]:
    """lighthouse.py's arguments after --bind HOST:PORT, wherever the lighthouse runs."""
    return [
        "--min-groups", str(min_groups),
        "--join-timeout-ms", str(int(fc.join_timeout * 1000)),
        "--heartbeat-timeout-ms", str(int(fc.heartbeat_timeout * 1000)),
    ]  # fmt: skip


class Lighthouse:
    """The lighthouse, started again on the same address whenever it dies."""

    def __init__(self, python: str, fc: FleetConfig, min_groups: int, run: pathlib.Path):
        self.run = run
        self.port = free_port()
        self.address = f"http://{fc.host}:{self.port}"
        self.cmd = [
            python, str(HERE / "lighthouse.py"), "--bind", f"{fc.host}:{self.port}",
            *lighthouse_args(fc, min_groups),
        ]  # fmt: skip
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "RUST_LOG": "warn"}
        proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL)
        line = {"group": "lighthouse", "process": 0, "pid": proc.pid, "start": time.time()}
        _append(self.run / "launch.jsonl", line)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                check_lighthouse(self.address, timeout=0.5)
                return proc
            except ConfigError:
                time.sleep(0.1)
        proc.kill()
        raise ConfigError(f"the lighthouse ({' '.join(self.cmd[:2])}) did not start; {MISSING}")

    def restart(self) -> None:
        self.proc = self._start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclasses.dataclass
class Group:
    index: int
    procs: list = dataclasses.field(default_factory=list)
    restarts: int = 0
    done: bool = False
    failed: int = 0  # the exit code it ended with, past its restarts


def _append(path: pathlib.Path, line: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def launch_groups(
    fc: FleetConfig, processes: int, devices_per_process: int, train_args: list[str],
    platform: str = "cpu", max_restarts: int = 0,
) -> int:  # fmt: skip
    """Runs the fleet to its end; returns 0, or the exit code of a group that failed past its
    restarts."""
    fleet = plan(fc, train_args, lambda: ft_python(fc.ft_python))
    args, python = fleet.args, fleet.settings.ft_python
    check_sidecar(python)
    if fc.lighthouse:
        check_lighthouse(fc.lighthouse)
    run = pathlib.Path(fleet.run_dir)
    min_groups = fleet.settings.min_groups
    lighthouse = None if fc.lighthouse else Lighthouse(python, fc, min_groups, run)
    child_env = {"GLOO_SOCKET_IFNAME": "lo"} if fc.host.startswith("127.") else {}
    base = dataclasses.replace(
        fleet.settings, run_dir=str(run), lighthouse=fc.lighthouse or lighthouse.address,
        host=fc.host, child_env=child_env,
    )  # fmt: skip
    groups = [Group(g) for g in range(fc.groups)]
    stopped: list[int] = []

    def start(group: Group, heal: bool) -> None:
        s = dataclasses.replace(base, group=group.index, store_port=free_port(), heal=heal)
        own = [*args, "--run-dir", str(run / "groups" / str(group.index))]
        port = free_port()
        group.procs = []
        for i in range(processes):
            p = _start(i, processes, devices_per_process, own, platform, port, {ENV: s.to_env()})
            group.procs.append(p)
            line = {"group": group.index, "process": i, "pid": p.pid, "start": time.time()}
            _append(run / "launch.jsonl", line)
            for source, to in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                prefix = f"[g{group.index}.p{i}] "
                threading.Thread(target=_stream, args=(source, prefix, {}, to), daemon=True).start()

    def forward(signum, frame):
        stopped.append(signum)
        for g in groups:
            for p in g.procs:
                if p.poll() is None:
                    p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for g in groups:
            start(g, heal=False)
        _supervise(groups, lighthouse, run, max_restarts, start, stopped)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for g in groups:
            for p in g.procs:
                if p.poll() is None:
                    p.kill()
        if lighthouse is not None:
            lighthouse.stop()
    bad = [g for g in groups if g.failed]
    return bad[0].failed if bad else 0


def _supervise(groups, lighthouse, run, max_restarts, start, stopped) -> None:
    while not all(g.done for g in groups):
        time.sleep(0.1)
        if lighthouse is not None and lighthouse.proc.poll() is not None and not stopped:
            code = lighthouse.proc.returncode
            sys.stderr.write(f"jaxdist launch: the lighthouse exited ({code}); starting it again\n")
            restarts.record(run, 0, 0, f"lighthouse exited with code {code}", "lighthouse")
            lighthouse.restart()
        for g in groups:
            if g.done:
                continue
            codes = [p.poll() for p in g.procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            short = None
            if not failed:
                if any(c is None for c in codes):
                    continue
                # A group whose processes all exited 0 is done, unless a signal that was not
                # the launcher's (a preemption notice to its host) stopped it short of the end.
                short = None if stopped else stopped_short(str(run / "groups" / str(g.index)))
                if short is None:
                    g.done = True
                    continue
            for p in g.procs:  # the group's other processes wait on the lost one: end them
                if p.poll() is None:
                    p.kill()
            if failed:
                i, code = failed[0]
                cause, exit_code = restarts.cause(i, code), code if code > 0 else 128 - code
            else:  # stopped short: the fleet's end is not reached
                cause, exit_code = short, 1
            cause = f"group {g.index}: {cause}"
            if stopped or g.restarts >= max_restarts:
                sys.stderr.write(f"jaxdist launch: {cause}; no restart left for it\n")
                g.done, g.failed = True, exit_code
                continue
            g.restarts += 1
            sys.stderr.write(
                f"jaxdist launch: {cause}; restart {g.restarts} of {max_restarts}: group "
                f"{g.index} alone starts again and heals from a live peer\n"
            )
            restarts.record(run, g.restarts, max_restarts, cause, f"group {g.index}")
            start(g, heal=True)
