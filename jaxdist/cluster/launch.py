"""`jaxdist launch`: N processes of one run on this host, over loopback, restarted on failure.

Each process gets its own devices (K fake CPU devices, or its share of the local GPUs), the
coordinator address, its id; its stdout and stderr reach the launcher's, each line prefixed
`[pN]`. The launcher returns the exit code of the first process that failed, naming it;
SIGTERM/SIGINT are passed on to every process (they save and exit, as a preempted run does).
With `--max-restarts N` a failed attempt is followed by another, up to N times, its cause (a
kill, a declared hang, a process's own one-line error) printed and recorded in
RUN_DIR/restarts.jsonl.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxdist.cluster import restarts
from jaxdist.cluster.manifests import split_run_dir
from jaxdist.errors import ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_HANG = "jaxdist: hang declared: "
_STOPPED = "jaxdist: stopped: "  # a process's one line when it stops the run on an error
PEER_GONE = "a peer process is gone"  # a stop that follows another process's death


def _stream(source, prefix: str, heard: dict, to) -> None:
    """Passes one of a process's streams on, prefixed, to the launcher's same stream (its
    stdout, the run's summary, to stdout: `jaxdist launch ... > result` keeps it, as
    `jaxdist train > result` does); keeps the first hang a process declared (its line names the
    stuck processes, which may not be the first to exit)."""
    for line in source:
        if line.startswith(_HANG):
            heard.setdefault("hang", line[len(_HANG) :].strip())
        elif line.startswith(_STOPPED):
            heard.setdefault("stopped", []).append((prefix, line[len(_STOPPED) :].strip()))
        to.write(f"{prefix}{line}")
        to.flush()


def _check(processes: int, devices_per_process: int, train_args: list[str]) -> None:
    if processes < 1 or devices_per_process < 1:
        raise ConfigError("--processes and --devices-per-process must be at least 1")
    if not train_args or train_args[0] != "train":
        raise ConfigError("launch runs `train`: write `jaxdist launch ... -- train --model ...`")
    for flag in ("--coordinator", "--num-processes", "--process-id"):
        if flag in train_args:
            raise ConfigError(f"launch sets {flag} itself; drop it from the train arguments")


def _start(
    i: int,
    processes: int,
    devices_per_process: int,
    train_args: list[str],
    platform: str,
    port,
    extra_env: dict | None = None,
) -> subprocess.Popen:
    """Process i of the run, on its own devices, its stdout and stderr piped for the `[pN]`
    streams. `extra_env`: variables set for it (a replica group's, jaxdist.groups.fleet)."""
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra_env or {})
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.cli",
        *train_args,
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(processes),
        "--process-id",
        str(i),
    ]
    if platform == "cpu":
        if "--devices" not in train_args:
            cmd += ["--devices", f"cpu:{devices_per_process}"]
    else:
        first = i * devices_per_process
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            str(d) for d in range(first, first + devices_per_process)
        )
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait(procs: list[subprocess.Popen], grace_s: float) -> tuple[int, int] | None:
    """Waits for every process; after the first failure, kills those still running `grace_s`
    later. Returns (index, exit code) of the first failure seen while running, or None."""
    first_failure: tuple[int, int] | None = None
    deadline = None
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc not in (None, 0) and first_failure is None:
                first_failure = (i, rc)
                deadline = time.monotonic() + grace_s
                sys.stderr.write(
                    f"jaxdist launch: process {i} exited with code {rc}; "
                    f"waiting up to {grace_s:.0f} s for the others\n"
                )
        if deadline and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    return first_failure


def launch(
    processes: int,
    devices_per_process: int,
    train_args: list[str],
    platform: str = "cpu",
    port: int | None = None,
    grace_s: float = 30.0,
    max_restarts: int = 0,
) -> int:
    """Runs `jaxdist <train_args>` as `processes` processes of one run; returns 0, or the exit
    code of the first process that failed (a signal's as 128 + its number).

    With `max_restarts`, a failed attempt (a process's non-zero exit, a kill, a declared hang;
    or a signal to one process that stopped the run short of its end) is followed by a new
    one, every process started again, up to that many times: each resumes from the newest good
    checkpoint, and each restart is printed and recorded in RUN_DIR/restarts.jsonl."""
    _check(processes, devices_per_process, train_args)
    run_dir = split_run_dir(train_args)[1]
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts} must be >= 0")
    if max_restarts and run_dir is None:
        raise ConfigError(
            "--max-restarts resumes each attempt from the run's checkpoints: give the train "
            "command --run-dir DIR"
        )
    stopped: list[int] = []  # a signal to the launcher itself: pass it on, never restart
    restart = 0
    while True:
        rc, cause = _attempt(
            processes, devices_per_process, train_args, platform, port, grace_s, stopped
        )
        if rc == 0 and cause is None or stopped:
            return rc
        if restart >= max_restarts:
            if rc == 0:
                sys.stderr.write(f"jaxdist launch: {cause}; no restart left\n")
            return rc if rc else 1
        restart += 1
        sys.stderr.write(
            f"jaxdist launch: restart {restart} of {max_restarts} after: {cause}; every process "
            "starts again and resumes from the newest good checkpoint\n"
        )
        restarts.record(run_dir, restart, max_restarts, cause, "launch")
        port = None  # a fresh coordinator port: the old one may linger in TIME_WAIT


def _attempt(processes, devices_per_process, train_args, platform, port, grace_s, stopped):
    """One attempt: every process started, streamed, waited for. Returns (exit code, why it
    needs a restart or None): the first failure's code and cause, or 0 and a cause when the
    run stopped short of its end on a signal the launcher did not send."""
    port = port or free_port()
    procs = [
        _start(i, processes, devices_per_process, train_args, platform, port)
        for i in range(processes)
    ]
    heard: dict = {}
    threads = [
        threading.Thread(target=_stream, args=(source, f"[p{i}] ", heard, to), daemon=True)
        for i, p in enumerate(procs)
        for source, to in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))
    ]
    for t in threads:
        t.start()

    def forward(signum, frame):
        stopped.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        first_failure = _wait(procs, grace_s)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for t in threads:
            t.join(timeout=5)
    if first_failure is None:
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
        first_failure = bad[0] if bad else None
    if first_failure:
        i, rc = first_failure
        cause = restarts.cause(i, rc)
        if rc == restarts.HANG_EXIT and "hang" in heard:  # "no step finished ...; stuck: ..."
            # Every process declares the hang; which exits first is a race (the stuck one
            # dumps its stacks first), so the line names the stuck process, not the first out.
            cause = "hang declared: " + heard["hang"].split(". Exiting")[0].split("; ", 1)[-1]
            sys.stderr.write(f"jaxdist launch: failed; {cause} (exit {rc})\n")
        else:
            sys.stderr.write(f"jaxdist launch: failed; process {i} was first to fail (exit {rc})\n")
            if own := _first_own_stop(heard.get("stopped", [])):
                cause = own
        return (rc if rc > 0 else 128 - rc), cause
    short = stopped_short(split_run_dir(train_args)[1])
    return 0, (None if stopped or short is None else short)


def _first_own_stop(lines: list[tuple[str, str]]) -> str | None:
    """The first one-line stop a process printed for a cause of its own ("checkpoint ... could
    not be restored"), not for a peer's death: the run's cause, whoever exited first (the
    others follow it, and may be quicker to go)."""
    for prefix, text in lines:
        if not text.startswith(PEER_GONE):
            return f"process {prefix.strip('[p] ')} stopped: {text.split('. ')[0][:240]}"
    return None


def stopped_short(run_dir: str | None) -> str | None:
    """Why a run whose processes all exited 0 is not done: a signal (not the launcher's)
    stopped it at a step boundary, as summary.json says; None when it finished."""
    if run_dir is None:
        return None
    try:
        summary = json.loads((pathlib.Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    at = summary.get("preempted_at")
    if at is None or at is False:
        return None
    return f"a signal stopped the run after step {at}, short of its end"
