"""How XLA's TPU compiler moves FSDP weights as the group grows, with no jaxdist in the program.

A plain JAX program: a scan over 4 layers of one [D, F] weight stored split over `fsdp` rows,
pinned to that layout inside the loop (as jaxdist and MaxText do), used twice per layer;
compiled deviceless for TPU v5p slices with the first N chips of the slice as the `fsdp` axis.
It prints the collectives of the compiled step by kind, bytes and trips.

What it shows (experiments/README.md, "At 8,192 chips"): without windowed matmuls (which
XLA chose for jaxdist's and MaxText's 7B at fsdp=8), the gradients are all-reduced whole and
then sliced at every group size: the compiler's reduce-scatter-decomposer, as in jaxdist's
405B at `fsdp=1024` on v5p-16384. Where the group is a whole torus (all of v5p:4x4x4, all of
v5p:4x4x8) the weight gathers become all-reduces of zero-padded shards too, as in jaxdist's
4-layer Llama at `fsdp=64` on v5p-128. Both are the compiler's choices for a plain program.

    python experiments/tpu_gathers.py        # needs the `tpu` extra (libtpu); about 2 minutes
"""

import argparse
import collections
import sys

# (slice, chips in the group): the first N chips of the slice, in the topology's order
CASES = (
    ("v5p:2x2x2", 8),
    ("v5p:4x4x4", 32),
    ("v5p:4x4x4", 64),
    ("v5p:4x4x8", 64),
    ("v5p:4x4x8", 128),
)


def compiled_collectives(topology: str, n: int, d: int, f: int) -> collections.Counter:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist.compiled import hlo

    devices = np.array(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    mesh = Mesh(devices[:n], ("fsdp",))
    rows = NamedSharding(mesh, P("fsdp", None))

    def loss(w_LDF, x_BD):
        def layer(x_BD, w_DF):
            w_DF = jax.lax.with_sharding_constraint(w_DF, rows)  # stored split, used whole
            return jnp.tanh(x_BD @ w_DF) @ w_DF.T, None

        y_BD, _ = jax.lax.scan(layer, x_BD, w_LDF)
        return jnp.sum(y_BD.astype(jnp.float32) ** 2)

    step = jax.jit(
        jax.grad(loss),
        in_shardings=(NamedSharding(mesh, P(None, "fsdp", None)), rows),
        out_shardings=NamedSharding(mesh, P(None, "fsdp", None)),
    )
    w = jax.ShapeDtypeStruct((4, d, f), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((8 * n, d), jnp.bfloat16)
    text = step.lower(w, x).compile().as_text()
    return collections.Counter(
        (c.kind, c.bytes, c.executions) for c in hlo.collectives(text, {"fsdp": n})
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-mlp", type=int, default=11008)
    args = p.parse_args(argv)
    from jaxdist.compiled import tpu

    if tpu.missing():
        sys.exit(tpu.missing())
    weight = 2 * args.d_model * args.d_mlp
    print(f"one layer's weight: {weight / 1e6:.1f} MB bf16; 4 layers")
    for topology, n in CASES:
        found = compiled_collectives(topology, n, args.d_model, args.d_mlp)
        rows = ", ".join(
            f"{count} {kind} of {nbytes / 1e6:.1f} MB x {trips}"
            for (kind, nbytes, trips), count in sorted(found.items())
        )
        print(f"{topology} fsdp={n}: {rows}", flush=True)


if __name__ == "__main__":
    main()
