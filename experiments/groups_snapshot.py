"""What a fleet's round cost each process before the healing snapshot was made on request:
the copy of its whole state to the host and through its sidecar's socket, every round, against
the change it sends either way.

    python experiments/groups_snapshot.py                    # tiny-llama and gpt2-124m
    python experiments/groups_snapshot.py --models 1b       # any preset

For each preset, on one process of two CPU devices (a group as the fleet tests run it): its
train state built as `jaxdist train` builds it; then, timed (median of --repeats, after a
warm-up), the snapshot as the member made it every round (outer weights, momentum, weights,
inner optimizer state: jaxdist.groups.member._snapshot's pieces, joined by wire.raw) and sent
over a Unix socket pair to a reader that keeps its bytes (the sidecar's copy), against the
round's float64 change alone, made and sent the same way. Since 54f78c9 a fleet without a
--sync-delay pays the first only when a peer heals from it.
"""

import argparse
import pathlib
import socket
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _reader(sock: socket.socket, n: int) -> None:
    from jaxdist.groups import wire

    for _ in range(n):
        header, arrays = wire.receive(sock)
        _ = [bytes(a) for a in arrays]  # the sidecar keeps the snapshot's bytes


def measure(model: str, repeats: int) -> dict:
    import jax
    import numpy as np

    from jaxdist.config import OptimConfig
    from jaxdist.groups import outer as host
    from jaxdist.groups import wire
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.mesh import make_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    mc = get_model_config(model)
    mesh = make_mesh("data=2")
    tx, lr = make_optimizer(OptimConfig(), 100)
    layout = Layout.on(mesh, STANDARD_RULES, StepConfig(), batch_size=2, seq_len=mc.seq_len)
    state = build(model_spec(mc).init, tx, lr, layout, mesh).init_fn()
    jax.block_until_ready(state)
    outer = host.OuterState.first(host.pieces(state.params))

    def change() -> list:
        theta = host.pieces(state.params)
        return [np.concatenate([c.ravel() for c in outer.parts(theta)]).astype(np.float64)]

    def snapshot() -> list:
        theta = host.pieces(state.params)
        inner = host.pieces(state._replace(params=None))
        head, data = wire.raw({"round": 0}, [*outer.params, *outer.momentum, *theta, *inner])
        return [np.frombuffer(data, np.uint8)]

    out = {"model": model, "params": sum(int(np.prod(p.shape)) for p in outer.params)}
    for name, make in (("change", change), ("snapshot", snapshot)):
        a, b = socket.socketpair()
        reader = threading.Thread(target=_reader, args=(b, repeats + 1))
        reader.start()
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            arrays = make()
            wire.send(a, {"op": name}, arrays)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
        reader.join()
        a.close()
        b.close()
        out[name] = {"bytes": sum(x.nbytes for x in arrays), "s_p50": statistics.median(times)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-llama,gpt2-124m")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from jaxdist.mesh import setup_devices

    setup_devices("cpu:2")
    for model in args.models.split(","):
        r = measure(model, args.repeats)
        c, s = r["change"], r["snapshot"]
        print(
            f"{model}: {r['params']:,} parameters; change {c['bytes'] / 1e6:.1f} MB in "
            f"{c['s_p50'] * 1e3:.1f} ms; snapshot {s['bytes'] / 1e6:.1f} MB in "
            f"{s['s_p50'] * 1e3:.1f} ms ({s['s_p50'] / c['s_p50']:.1f}x) a round, median of "
            f"{args.repeats}"
        )


if __name__ == "__main__":
    main()
