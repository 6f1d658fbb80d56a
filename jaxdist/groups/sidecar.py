"""The torchft side of one process of a replica group, run by the sidecar interpreter (Python
3.11 with torch==2.13.0 and torchft==0.2.0; see jaxdist.groups): it imports no JAX and is run
as a script, `python sidecar.py --socket PATH ...`, by its JAX process (jaxdist.groups.bridge).

Each round the JAX process sends, over a Unix socket, its change (one float64 vector, its pieces
of the round's fragment joined, or with a 16- or 8-bit --sync-dtype the bytes of the change in
that type). The state a healing peer would need (outer weights, momentum, weights, its inner
state, round, step and fragment) comes with it where the group trains on during the round
(--sync-delay); without a delay the sidecar asks for it only when the quorum names a peer that
heals from this group (the JAX process, waiting for the round's end, answers). The sidecar
runs torchft's Manager: a quorum from the
lighthouse (healing this group from a peer if it is behind), one all-reduce (a sum) among the
same-rank processes of the groups in the quorum, or for bytes one all-gather (the JAX process
dequantizes and sums them: these bytes are never decoded here), `should_commit` within the
group; it answers the sum or the participants' bytes, the groups that took part (a one-hot slot
per group, sent along), whether the round committed, and the state it healed from, if it did.

Healing moves arrays only (`ArrayTransport`: lengths, a JSON header and raw bytes over the
quorum's Gloo group); torchft's own transports unpickle what a peer sends. What listens binds
the run's host: torchft's manager server (every interface in 0.2.0: `_bind_named`), the
group's store (on a socket bound here), Gloo (GLOO_SOCKET_IFNAME, set by the launcher for
loopback).
"""

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import torch
import torchft.manager as ft_manager
from torch.distributed import ReduceOp, TCPStore
from torch.distributed.distributed_c10d import AllgatherOptions
from torchft.checkpointing.transport import CheckpointTransport
from torchft.process_group import ProcessGroupGloo
from wire import receive, send  # this file's directory, run as a script

_U8, _I64 = torch.uint8, torch.int64


def _bytes_tensor(b: bytes) -> torch.Tensor:
    # Gloo sends no empty tensor: one byte stands in for none.
    return torch.frombuffer(bytearray(b or b"\0"), dtype=_U8)


class ArrayTransport(CheckpointTransport):
    """A peer's state dict as lengths, a JSON header and raw bytes over the process group."""

    def __init__(self, pg, timeout: timedelta):
        self._pg, self._timeout = pg, timeout

    def metadata(self) -> str:
        return "arrays"

    def disallow_checkpoint(self) -> None:
        pass

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        snap = state_dict["user"]["default"]
        meta = json.dumps({"torchft": state_dict["torchft"], "step": step}).encode()
        parts = [meta, snap["head"], snap["data"]]
        lengths = torch.tensor([len(p) for p in parts], dtype=_I64)
        for dst in dst_ranks:
            self._pg.send([lengths], dst, tag=1).wait(timeout)
            for tag, p in enumerate(parts, start=2):
                self._pg.send([_bytes_tensor(p)], dst, tag=tag).wait(timeout)

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        lengths = torch.zeros(3, dtype=_I64)
        self._pg.recv([lengths], src_rank, tag=1).wait(timeout)
        parts = []
        for tag, n in enumerate(lengths.tolist(), start=2):
            buf = torch.zeros(max(n, 1), dtype=_U8)
            self._pg.recv([buf], src_rank, tag=tag).wait(timeout)
            parts.append(buf.numpy().tobytes()[:n])
        meta = json.loads(parts[0])
        return {
            "user": {"default": {"head": parts[1], "data": parts[2]}},
            "torchft": meta["torchft"],
        }

    def shutdown(self, wait: bool = True) -> None:
        pass


class _Gloo(ProcessGroupGloo):
    """Gloo whose rendezvous keys name the quorum's newest committed round beside its id: a
    lighthouse started again numbers its quorums from the start, and Gloo would meet the old
    quorum's stale addresses under a reused id."""

    epoch = 0

    def configure(self, store_addr, *args, **kwargs):
        return super().configure(f"{store_addr}/round{self.epoch}", *args, **kwargs)


class _Quorums:
    """torchft's manager client, passing each quorum's newest round to the process group."""

    def __init__(self, client, pg: _Gloo):
        self._client, self._pg = client, pg

    def _quorum(self, *args, **kwargs):
        found = self._client._quorum(*args, **kwargs)
        self._pg.epoch = found.max_step
        return found

    def __getattr__(self, name):
        return getattr(self._client, name)


def _bind_named(host: str) -> None:
    """torchft 0.2.0's Manager starts its server on [::] (every interface): on `host` instead."""
    server = ft_manager.ManagerServer

    def bound(**kwargs):
        kwargs["bind"] = f"{host}:0"
        return server(**kwargs)

    ft_manager.ManagerServer = bound


def _watch_parent() -> None:
    """The sidecar ends with its JAX process (a kill -9 of it must silence this group's
    heartbeat, or the lighthouse would wait for a group that is gone)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.1)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class Sidecar:
    def __init__(self, args, sock):
        self.args, self.sock = args, sock
        # The JAX process's socket: the main thread's rounds and the quorum thread's requests
        # for a snapshot take turns on it.
        self.io = threading.Lock()
        self.snapshot = {"head": b'{"arrays": []}', "data": b""}
        self.healed = None
        timeout = timedelta(seconds=args.timeout)
        self.store = None
        if args.rank == 0:  # the group's store (the Manager only ever connects to one)
            # On a socket bound here: TCPStore's own listens on every interface.
            self.listener = socket.create_server((args.host, args.store_port), backlog=128)
            self.store = TCPStore(
                args.host, args.store_port, is_master=True, wait_for_workers=False,
                master_listen_fd=self.listener.fileno(), use_libuv=False,
            )  # fmt: skip
        pg = _Gloo(timeout=timeout)
        _bind_named(args.host)
        self.manager = ft_manager.Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=self._state_dict,
            min_replica_size=args.min_groups,
            use_async_quorum=False,  # a round's quorum before its all-reduce: healing first
            timeout=timeout,
            quorum_timeout=timedelta(seconds=args.quorum_timeout),
            connect_timeout=timedelta(seconds=args.quorum_timeout),
            rank=args.rank,
            world_size=args.ranks,
            store_addr=args.host,
            store_port=args.store_port,
            lighthouse_addr=args.lighthouse,
            replica_id=f"group_{args.group}",
            hostname=args.host,
            checkpoint_transport=ArrayTransport(pg, timeout),
            init_sync=False,  # every group starts from the same seed's weights
            quorum_retries=args.quorum_retries,
        )
        self.manager._client = _Quorums(self.manager._client, pg)

    def _load(self, snap) -> None:
        self.healed = snap

    def _state_dict(self) -> dict:
        """What a peer healing from this group gets (called in the quorum, on torchft's
        thread): the round's snapshot as sent, or asked of the JAX process now, which is
        waiting for this round's end."""
        if self.snapshot is None:
            with self.io:
                send(self.sock, {"op": "snapshot"})
                header, arrays = receive(self.sock)
            if header.get("op") != "snapshot":
                raise RuntimeError(f"asked for a snapshot, got {header.get('op')!r}")
            self.snapshot = {"head": header["snapshot_head"].encode(), "data": bytes(arrays[0])}
        return self.snapshot

    def round(self, header: dict, arrays: list) -> tuple[dict, list]:
        """One round: quorum (and healing), the all-reduce (or all-gather), the commit vote."""
        M, G = self.args.groups, self.args.group
        # Sent with the change (a group that trains on during its round), or asked for.
        sent = "snapshot_head" in header
        self.snapshot = (
            {"head": header["snapshot_head"].encode(), "data": bytes(arrays[1])} if sent else None
        )
        self.healed = None
        t0 = time.monotonic()
        self.manager.start_quorum()
        quorum_s = time.monotonic() - t0
        joined = header["participating"] and self.healed is None
        # A group that joins to heal sends zeros of the size its peers send (the round's
        # fragment, which its peer's state names); the collective needs equal sizes.
        n = json.loads(self.healed["head"])["payload"] if self.healed else arrays[0].size
        gather = header.get("gather", False)
        vec = np.zeros(n + M, np.uint8 if gather else np.float64)
        vec[:n] = arrays[0] if joined else 0
        vec[n + G] = 1 if joined else 0  # a one-hot slot per group: who took part
        if gather:
            parts = self._gathered(torch.from_numpy(vec))
            slots = [p[n:] for p in parts]
            ones = np.sum(slots, axis=0) if slots else np.zeros(M)
            by_group = {
                int(np.argmax(s)): p[:n] for p, s in zip(parts, slots, strict=True) if s.any()
            }
            out = [by_group[g] for g in sorted(by_group)]
        else:
            summed = torch.from_numpy(vec)
            self.manager.allreduce(summed, reduce_op=ReduceOp.SUM).wait()
            ones, out = summed[n:].numpy(), [summed[:n].numpy()]
        committed = self.manager.should_commit()
        err = self.manager.errored()
        reply = {
            "committed": bool(committed),
            "participants": [g for g in range(M) if ones[g] > 0.5],
            "quorum": int(self.manager._quorum_id),  # the lighthouse's id of this membership
            "healed": self.healed is not None,
            "gathered": gather,
            "quorum_s": quorum_s,
            "round_s": time.monotonic() - t0,
            "error": str(err.original_exception).splitlines()[0][:300] if err else None,
        }
        return reply, out

    def _gathered(self, mine: torch.Tensor) -> list[np.ndarray]:
        """Every quorum member's bytes (the sync type's change: summed by the JAX process, in
        float64, after dequantizing); an error is the Manager's, as its all-reduce reports."""
        m = self.manager
        if m.errored():
            return []
        m.wait_quorum()
        try:
            out = [torch.empty_like(mine) for _ in range(m._pg.size())]
            m._pg.allgather([out], [mine], AllgatherOptions()).wait(m._timeout)
        except Exception as e:  # noqa: BLE001 - the round fails, as a failed all-reduce does
            m.report_error(e)
            return []
        return [o.numpy() for o in out]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--min-groups", type=int, default=1)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--quorum-timeout", type=float, default=120.0)
    p.add_argument("--quorum-retries", type=int, default=20)
    args = p.parse_args(argv)
    # torchft's info and warnings (e.g. about NCCL's flight recorder, on a Gloo-only host) are
    # noise in the run's log; its errors and the exceptions it logs stay.
    logging.getLogger("torchft").setLevel(logging.ERROR)
    _watch_parent()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    try:
        side = Sidecar(args, sock)
    except Exception as e:  # noqa: BLE001 - said in one line to the JAX process
        send(sock, {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
        return 1
    send(sock, {"ok": True, "torch": torch.__version__})
    while True:
        try:
            with side.io:
                header, arrays = receive(sock)
        except Exception:  # noqa: BLE001 - the JAX process closed its end: the run is over
            break
        if header.get("op") == "close":
            break
        try:
            reply, out = side.round(header, arrays)
        except Exception as e:  # noqa: BLE001 - a lost round, said; the next one tries again
            reply = {"committed": False, "participants": [], "quorum": -1, "healed": False,
                     "quorum_s": 0.0, "round_s": 0.0,
                     "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}  # fmt: skip
            out = [] if header.get("gather") else [np.zeros_like(arrays[0])]
            reply["gathered"] = bool(header.get("gather"))
            side.healed = None
        with side.io:  # after a snapshot asked for, if a late quorum thread still asks
            send(sock, reply, out)
            if side.healed is not None:  # the peer's state, as it sent it (never decoded here)
                from wire import _LENGTHS

                head, data = side.healed["head"], side.healed["data"]
                sock.sendall(_LENGTHS.pack(len(head), len(data)) + head + data)
    side.manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
