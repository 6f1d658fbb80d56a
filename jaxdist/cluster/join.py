"""Many processes, one program: JAX's distributed runtime, explicit or detected.

Every process runs the same step on its own devices and feeds its own rows of the batch;
process 0 alone writes logs. If a process dies, JAX's coordination service notices within
the heartbeat timeout and ends the others (fate sharing), naming the lost task; a process that
stops on an error says why in the key-value store first (`leave`), and the others end at once;
a relaunch resumes from the last checkpoint.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import sys
import threading
import time
from typing import TYPE_CHECKING, Annotated

import numpy as np
import tyro

from jaxdist.errors import ConfigError

# The processes' flags (DistributedConfig) are parsed without jax; joining loads it.
if TYPE_CHECKING:
    import jax

# JAX's own cluster detection reads these (Slurm, Open MPI, Kubernetes).
_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST")
# Gloo, the CPU collectives, prints this on stdout for every communicator it connects (32 lines
# before a two-process run's first step) from C++, unconditionally: no flag or environment
# variable turns it off (gloo/transport/tcp/context.cc, printConnectivityInfo). Only the line
# saying every expected peer connected is dropped; "is NOT connected" and the rest pass.
_GLOO_CONNECTED = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    rb"Expected number of connected peer ranks is : (\d+)\s*"
)
# Communicators connect on several threads at once, whose messages interleave piece by piece
# (each `<<` apart): such a line holds these pieces and numbers, and nothing else.
_GLOO_PIECES = re.compile(
    rb"\[Gloo\] Rank |is connected to |peer ranks\. |Expected number of connected peer ranks is : "
)
_quieted = False  # stdout already goes through the filter


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str | None = None
    """HOST:PORT of process 0, for a multi-process run (else Slurm/MPI/K8s are detected)"""
    num_processes: int | None = None
    """processes in the run (with --coordinator)"""
    process_id: int | None = None
    """this process's index, 0 to N-1 (with --coordinator)"""
    heartbeat_timeout_s: Annotated[int, tyro.conf.arg(aliases=("--heartbeat-timeout",))] = 100
    """seconds of silence after which a peer process is declared dead"""

    def explicit(self) -> bool:
        return any(v is not None for v in (self.coordinator, self.num_processes, self.process_id))

    def validate(self) -> None:
        if self.explicit() and None in (self.coordinator, self.num_processes, self.process_id):
            raise ConfigError(
                "--coordinator, --num-processes and --process-id go together; "
                "give all three (or none, to detect Slurm/MPI/Kubernetes)"
            )
        if self.explicit():
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"--coordinator {self.coordinator!r} is not HOST:PORT")
            if not 0 <= self.process_id < self.num_processes:
                raise ConfigError(
                    f"--process-id {self.process_id} must lie in [0, {self.num_processes})"
                )
        if self.heartbeat_timeout_s < 1:
            raise ConfigError("--heartbeat-timeout must be at least 1 second")


def cluster_detected() -> bool:
    return (
        any(k in os.environ for k in _CLUSTER_ENV)
        and "SLURM_STEP_NODELIST" in os.environ
        or "OMPI_MCA_orte_hnp_uri" in os.environ
    )


def initialize(config: DistributedConfig, cpu: bool) -> bool:
    """Joins the job; must run before anything starts a JAX backend. True if multi-process."""
    import jax

    config.validate()
    if not config.explicit() and not cluster_detected():
        return False
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        quiet_gloo()
    kwargs = {"heartbeat_timeout_seconds": config.heartbeat_timeout_s}
    if config.explicit():
        kwargs |= {
            "coordinator_address": config.coordinator,
            "num_processes": config.num_processes,
            "process_id": config.process_id,
            "cluster_detection_method": "deactivate",
        }
    jax.distributed.initialize(**kwargs)
    return True


def gloo_noise(line: bytes) -> bool:
    """A line of gloo's saying communicators connected to all their peers, as expected (or
    pieces of several such messages, interleaved)."""
    whole = _GLOO_CONNECTED.fullmatch(line)
    if whole:
        return whole[1] == whole[2]
    rest = _GLOO_PIECES.sub(b"", line)
    return rest != line and re.fullmatch(rb"[\d\s]+", rest) is not None


def quiet_gloo() -> None:
    """This process's stdout (fd 1, which gloo's C++ writes to) through a pipe whose reader
    drops gloo's all-connected lines and passes everything else on, line by line; restored at
    exit, once the reader has passed on what was left. Once per process."""
    global _quieted
    if _quieted:
        return
    try:
        sys.stdout.flush()
        real = os.dup(1)
        read, write = os.pipe()
    except (OSError, ValueError):  # no usable stdout: nothing to keep quiet
        return
    os.dup2(write, 1)
    os.close(write)
    reader = threading.Thread(target=_forward, args=(read, real), daemon=True, name="gloo-quiet")
    reader.start()
    _quieted = True

    def restore():
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(real, 1)  # closes the pipe's last writer: the reader sees the end
        reader.join(timeout=5)

    atexit.register(restore)


def _forward(read: int, real: int) -> None:
    pending = b""
    while chunk := os.read(read, 1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        kept = b"".join(line + b"\n" for line in lines if not gloo_noise(line))
        _write_all(real, kept)
    _write_all(real, pending)
    os.close(read)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


ENDED = "jaxdist/end/"  # a process that stops the run posts why here (watchdog reads it)


def client():
    """The key-value store of JAX's coordination service, where the processes of a run agree
    (None before jax.distributed.initialize). The one private name jaxdist reads from JAX:
    jax 0.11.2 has no public one for it (orbax and jax.experimental read it the same way)."""
    from jax._src import distributed

    return distributed.global_state.client


def leave(code: int, why: str, exit_now: bool = True) -> None:
    """A process of several that stops with an error (a restore that fails, a save that cannot
    be written, a bug) tells the others why (their watchdogs end them at once, naming it) and,
    with `exit_now`, exits without JAX's shutdown barrier, which would hold it for minutes
    waiting for peers that still train. Without it (an unexpected error, often a peer's death
    seen from here), the process ends as usual: JAX's shutdown then names a lost peer.
    Returns when the run has one process, JAX is not distributed, or not `exit_now`."""
    import jax

    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return
    me = jax.process_index()
    try:
        client().key_value_set(f"{ENDED}stopped-{me}", why.partition("\n")[0][:500])
    except Exception:  # noqa: BLE001 - the service may be gone: the heartbeat tells them
        pass
    if not exit_now:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    time.sleep(1.0 if me == 0 else 0.0)  # process 0 serves the store: let the others read it
    os._exit(code)


def local_value(x: jax.Array) -> np.ndarray:
    """A replicated array's value, read from this process's own copy.

    `jax.device_get` refuses arrays that span other processes' devices.
    """
    return np.asarray(x.addressable_shards[0].data)


def metric_value(name: str, x: jax.Array) -> float | bool:
    """A logged metric's value from this process's own shards: a scalar as it is; one per
    replica group ([M], each group's own, never reduced on the devices) averaged over the
    groups this process holds (`finite` where all of them are). On one host that is every
    group, so the mean over the whole batch; across hosts, this process's groups."""
    per_group = {s.index: np.asarray(s.data) for s in x.addressable_shards}  # dedupe copies
    values = np.concatenate([v.reshape(-1) for v in per_group.values()])
    return bool(values.all()) if name == "finite" else float(values.mean())


def process_rows(sharding, global_shape: tuple[int, ...]) -> range:
    """The batch rows this process's devices hold, which it alone must read."""
    import jax

    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        r = index[0]
        rows.update(range(*r.indices(global_shape[0])))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ConfigError(
            f"process {jax.process_index()}'s devices hold batch rows that are not contiguous "
            f"({sorted(rows)[:8]}...); order the mesh so the batch axes are outermost"
        )
    return range(lo, hi)
