"""Study: what the TPU compiler's memory analysis counts beyond its own buffer assignment.

`jaxdist plan --verify` sets the planner's memory beside XLA's `memory_analysis()`. On TPU (v5p,
compiled from this host with libtpu) that figure exceeds the total of the buffer assignment XLA
itself dumps (`--xla_dump_to`) by gigabytes on the pipelined 1b layouts, where the planner
agrees with the assignment. This study isolates the pattern with a pipeline's skeleton:
a loop of ticks, each running a stage's L layers backward (`jax.vjp` of a layer scan) and
adding their weight gradient into an accumulator the loop carries; a "once" variant runs one
tick without the loop. For each, it prints XLA's temporaries, the buffer assignment's
preallocated temporaries, their difference, and the accumulator and weight bytes beside it.

    python experiments/tpu_loop_state.py   # needs the tpu extra (libtpu); under a minute

Writes experiments/results/tpu_loop_state.json.
"""

import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

D, ROWS, TICKS = 2048, 2, 8  # width, rows per device, backward ticks of the loop
RESULTS = Path(__file__).parent / "results"


def one(layers: int, acc_dtype: str, looped: bool) -> None:
    """Compiles one variant in this process (XLA's dump flag is read at start) and prints."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist.compiled.tpu import tpu_devices

    mesh = Mesh(np.array(tpu_devices("v5p:4x4x4")).reshape(64), ("x",))

    def body(w_L2DD, x_bTD):
        def layer(h, w_2DD):
            return h + jnp.tanh(h @ w_2DD[0]) @ w_2DD[1], None

        return jax.lax.scan(layer, x_bTD, w_L2DD)[0]

    def backward(g, w, x):
        _, vjp = jax.vjp(body, w, x)
        gw, dx = vjp(x)
        return g + gw.astype(g.dtype), dx

    def per_device(w, x):
        g = jnp.zeros(w.shape, acc_dtype)
        if looped:

            def tick(carry, _):
                return backward(*carry[:1], w, carry[1]), None

            (g, x), _ = jax.lax.scan(tick, (g, x), None, TICKS)
        else:
            g, x = backward(g, w, x)
        return g.astype(jnp.float32).sum() + x.astype(jnp.float32).sum()

    w = jax.ShapeDtypeStruct((layers, 2, D, D), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct(
        (64 * ROWS, 2048, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("x"))
    )
    step = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(), check_vma=False
    )
    temp = jax.jit(step).lower(w, x).compile().memory_analysis().temp_size_in_bytes
    dump = os.environ["XLA_FLAGS"].split("=", 1)[1]
    text = open(glob.glob(f"{dump}/*jit_per_device*buffer-assignment.txt")[0]).read()
    assigned = int(re.search(r"size (\d+), page 0, preallocated-temp", text).group(1))
    acc = layers * 2 * D * D * jnp.dtype(acc_dtype).itemsize
    weights = layers * 2 * D * D * 2
    row = {"layers": layers, "accumulator": acc_dtype, "ticks": "loop" if looped else "once"}
    row |= {"xla_temp": temp, "assigned": assigned, "beyond": temp - assigned}
    print(json.dumps(row | {"accumulator_bytes": acc, "weight_bytes": weights}))


def main() -> None:
    head = "layers accumulator ticks XLA_temp_MB assigned_MB beyond_MB acc+weights_MB"
    print("| " + " | ".join(head.split()) + " |")
    print("|" + " --- |" * 7)
    rows = []
    for layers, acc, looped in [
        (4, "float32", True),
        (8, "float32", True),
        (16, "float32", True),
        (8, "bfloat16", True),
        (8, "float32", False),
    ]:
        with tempfile.TemporaryDirectory() as dump:
            env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump}", "JAX_PLATFORMS": "cpu"}
            args = [sys.executable, __file__, str(layers), acc, str(int(looped))]
            out = subprocess.run(args, env=env, capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr[-2000:])
            r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        mb = [r[k] / 1e6 for k in ("xla_temp", "assigned", "beyond")]
        both = (r["accumulator_bytes"] + r["weight_bytes"]) / 1e6
        cells = [r["layers"], r["accumulator"], r["ticks"], *(f"{v:.0f}" for v in (*mb, both))]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tpu_loop_state.json").write_text(json.dumps({"v5p:4x4x4": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 4:
        one(int(sys.argv[1]), sys.argv[2], bool(int(sys.argv[3])))
    else:
        main()
