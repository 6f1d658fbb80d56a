"""The embedding lookup's gradient: equal to jnp.take's, and reduce-scattered into the table's
stored layout (never summed whole over the batch's devices), on every layout; the TPU's ring
of permutes equal to psum_scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.kernels.lookup import lookup, reduce_scatter
from jaxdist.planning import hlo
from jaxdist.rules import activation_rules, constrain
from meshes.presets import STANDARD_RULES as RULES
from tests.helpers import mesh_for

V, D, B, T = 64, 32, 8, 16
TABLE = ("vocab", "embed")


def _inputs():
    table_VD = jax.random.normal(jax.random.PRNGKey(0), (V, D))
    # Some ids repeat many times, as frequent tokens do: their rows sum many gradients.
    ids_BT = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, V // 4) * 4
    w_BTD = jax.random.normal(jax.random.PRNGKey(2), (B, T, D))
    return table_VD, ids_BT, w_BTD


@pytest.mark.parametrize(
    "layout, scattered, summed",
    [
        ("fsdp=8", "fsdp", None),
        ("data=2,fsdp=2,tensor=2", "fsdp", "data"),
        ("context=2,fsdp=2,data=2", "fsdp+context", "data"),
        ("expert=2,fsdp=2,tensor=2", "fsdp", "expert"),
    ],
)
def test_lookup_gradient_is_takes_reduce_scattered_where_stored(layout, scattered, summed):
    table_VD, ids_BT, w_BTD = _inputs()
    want = jax.grad(lambda t: jnp.sum(jnp.take(t, ids_BT, axis=0) * w_BTD))(table_VD)
    mesh = mesh_for(layout)

    def loss(t, ids, w):
        with activation_rules(RULES, mesh):
            x_BTD = constrain(lookup(t, ids, TABLE), ("batch", "seq", "embed"))
            return jnp.sum(x_BTD * w)

    def sharding(logical, kind="activation"):
        return NamedSharding(mesh, RULES.spec(logical, kind))

    step = jax.jit(
        jax.grad(loss),
        in_shardings=(
            sharding(TABLE, "param"),
            sharding(("batch", "seq")),
            sharding(("batch", "seq", "embed")),
        ),
    )
    got = step(table_VD, ids_BT, w_BTD)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert got.sharding.is_equivalent_to(sharding(TABLE, "param"), 2), got.sharding
    rows = hlo.summarize(
        hlo.collectives(step.lower(table_VD, ids_BT, w_BTD).compile().as_text(), dict(mesh.shape))
    )
    # The stored table's bytes on this device's vocabulary slice (the tensor split), f32.
    local = V * D * 4 / mesh.shape.get("tensor", 1)
    assert rows[(scattered, "reduce-scatter")]["bytes"] == local, rows
    summed_bytes = {k: r["bytes"] for k, r in rows.items() if k[1] == "all-reduce"}
    # What is left to all-reduce is the slice (the whole table before: XLA's transpose of the
    # lookup summed it over every batch axis, then sliced it).
    want_summed = {
        (summed, "all-reduce"): local / mesh.shape["fsdp"] / mesh.shape.get("context", 1)
    }
    assert summed_bytes == (want_summed if summed else {}), rows


@pytest.mark.parametrize("axes", [("fsdp",), ("fsdp", "context")])
def test_ring_of_permutes_equals_psum_scatter(axes):
    mesh = mesh_for("context=2,fsdp=2,data=2")
    n = int(np.prod([mesh.shape[a] for a in axes]))
    # A different array on every device: [8 devices, 6, n * 3].
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 6, n * 3))
    spec = PartitionSpec(("data", "fsdp", "context"))

    def scatter(ring):
        def body(x):
            return reduce_scatter(x[0], axes, 1, n, ring)[None]

        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        )

    np.testing.assert_allclose(scatter(True)(x), scatter(False)(x), rtol=1e-6, atol=1e-6)
    hlo_text = scatter(True).lower(x).compile().as_text()
    assert "collective-permute" in hlo_text and "reduce-scatter" not in hlo_text
