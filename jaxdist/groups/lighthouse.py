"""torchft's lighthouse (the quorum of replica groups), run by the sidecar interpreter as a
script: `python lighthouse.py --bind HOST:PORT --min-groups N ...`. It imports no JAX. The
launcher (jaxdist.groups.fleet) supervises it and starts it again on the same address when it
dies; the groups' managers retry their quorum meanwhile (--quorum-retries), so its restart
costs no round.
"""

import argparse
import os
import signal
import sys
import threading


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bind", required=True)
    p.add_argument("--min-groups", type=int, default=1)
    p.add_argument("--join-timeout-ms", type=int, default=5000)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=3000)
    p.add_argument("--quorum-tick-ms", type=int, default=50)
    args = p.parse_args(argv)
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_groups,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(f"lighthouse at {server.address()}", flush=True)
    done = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: done.set())
    parent = os.getppid()
    while not done.wait(0.5):
        if os.getppid() != parent:  # the launcher is gone (even by kill -9): so is the fleet
            break
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
