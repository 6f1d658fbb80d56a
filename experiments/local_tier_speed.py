"""The node-local tier's save against the persistent (Orbax) one, same state: blocked and total.

    python experiments/local_tier_speed.py                        # tiny, 8 fake CPU devices
    python experiments/local_tier_speed.py --model gpt2-124m --local-dir /dev/shm/jaxdist-local

Each tier saves the same train state `--repeats` times after one warm-up save (which pays the
fingerprint's compile and Orbax's setup) and waits for each save: "blocked" is what save()
returns (what the training loop pays), "total" is until the commit. Prints one JSON line of
the medians and the raw times.
"""

import argparse
import json
import pathlib
import statistics
import tempfile
import time


def timed(tier, state, repeats: int) -> dict:
    blocked, total = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        blocked.append(tier.save(i, state, {}))
        tier.wait()
        total.append(time.perf_counter() - t0)
    tier.close()
    return {
        "blocked_s_p50": statistics.median(blocked[1:]),
        "total_s_p50": statistics.median(total[1:]),
        "blocked_s": blocked[1:],
        "total_s": total[1:],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--devices", default="cpu:8")
    ap.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="persistent tier's directory (default: temp)")
    ap.add_argument("--local-dir", default=None, help="local tier's directory (default: temp)")
    args = ap.parse_args()

    from jaxdist.mesh import setup_devices

    setup_devices(args.devices)
    import jax

    from jaxdist.checkpoint.local import LocalTier
    from jaxdist.checkpoint.store import Checkpointer
    from jaxdist.config import OptimConfig
    from jaxdist.layout import Layout
    from jaxdist.mesh import make_mesh
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build
    from meshes.presets import STANDARD_RULES
    from models.presets import get_model_config, model_spec

    mesh = make_mesh(args.mesh)
    tx, lr = make_optimizer(OptimConfig(), 100)
    spec = model_spec(get_model_config(args.model))
    at = Layout.on(mesh, STANDARD_RULES, batch_size=mesh.size, seq_len=spec.seq_len)
    jitted = build(spec.init, tx, lr, at, mesh)
    state = jax.block_until_ready(jitted.init_fn())
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="jaxdist-persistent-"))
    local_root = pathlib.Path(args.local_dir or tempfile.mkdtemp(prefix="jaxdist-local-"))
    result = {"model": args.model, "state_mb": nbytes / 1e6, "devices": mesh.size}
    result["orbax"] = timed(Checkpointer(root / "ckpt", keep=1), state, args.repeats)
    result["local"] = timed(LocalTier(local_root, keep=1), state, args.repeats)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
