"""The embedding lookup: rows and gradient equal to jnp.take's on every layout. Gathered (a
device's tokens at least the table's rows): the gradient reduce-scattered into the table's
stored layout, never summed whole over the batch's devices; the TPU's ring of permutes equal
to psum_scatter. Routed (fewer tokens): an all-to-all of the tokens' rows each way, the table
never gathered nor its gradient reduce-scattered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.compiled import hlo
from jaxdist.kernels.lookup import lookup, reduce_scatter, routing
from jaxdist.layout import Layout
from jaxdist.rules import activation_rules, constrain
from meshes.presets import STANDARD_RULES as RULES
from tests.helpers import mesh_for

V, D, B = 64, 32, 8
TABLE = ("vocab", "embed")
LAYOUTS = [
    ("fsdp=8", "fsdp", None),
    ("data=2,fsdp=2,tensor=2", "fsdp", "data"),
    ("context=2,fsdp=2,data=2", "fsdp+context", "data"),
    ("expert=2,fsdp=2,tensor=2", "fsdp", "expert"),
]


def _inputs(T: int):
    table_VD = jax.random.normal(jax.random.PRNGKey(0), (V, D))
    # Some ids repeat many times, as frequent tokens do: their rows sum many gradients.
    ids_BT = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, V // 4) * 4
    w_BTD = jax.random.normal(jax.random.PRNGKey(2), (B, T, D))
    return table_VD, ids_BT, w_BTD


def _compiled(layout: str, T: int, forward: bool = False):
    """Checks the lookup's rows and gradient against jnp.take's; returns the mesh and the
    gradient step's collectives (`forward`: a step that also returns the loss, so the forward's
    exchange stays in the program)."""
    table_VD, ids_BT, w_BTD = _inputs(T)
    want = jax.grad(lambda t: jnp.sum(jnp.take(t, ids_BT, axis=0) * w_BTD))(table_VD)
    mesh = mesh_for(layout)

    def rows(t, ids):
        with activation_rules(Layout.on(mesh, RULES), mesh):
            return constrain(lookup(t, ids, TABLE), ("batch", "seq", "embed"))

    def sharding(logical, kind="activation"):
        return NamedSharding(mesh, RULES.spec(logical, kind))

    ins = (sharding(TABLE, "param"), sharding(("batch", "seq")))
    differentiate = jax.value_and_grad if forward else jax.grad
    step = jax.jit(
        differentiate(lambda t, ids, w: jnp.sum(rows(t, ids) * w)),
        in_shardings=(*ins, sharding(("batch", "seq", "embed"))),
    )
    got = step(table_VD, ids_BT, w_BTD)
    if forward:
        loss, got = got
        np.testing.assert_allclose(loss, jnp.sum(jnp.take(table_VD, ids_BT, axis=0) * w_BTD), 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert got.sharding.is_equivalent_to(sharding(TABLE, "param"), 2), got.sharding
    x_BTD = jax.jit(rows, in_shardings=ins)(table_VD, ids_BT)
    np.testing.assert_array_equal(x_BTD, jnp.take(table_VD, ids_BT, axis=0))
    text = step.lower(table_VD, ids_BT, w_BTD).compile().as_text()
    return mesh, hlo.summarize(hlo.collectives(text, dict(mesh.shape)))


@pytest.mark.parametrize("layout, scattered, summed", LAYOUTS)
def test_lookup_gradient_is_takes_reduce_scattered_where_stored(layout, scattered, summed):
    mesh, rows = _compiled(layout, T=64)  # 64 to 128 tokens a device, 32 to 64 table rows
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


@pytest.mark.parametrize("layout, split, summed", LAYOUTS)
def test_few_tokens_are_routed_to_the_tables_slices(layout, split, summed):
    mesh, rows = _compiled(layout, T=4, forward=True)  # 4 to 8 tokens a device
    tokens = B * 4 // np.prod([mesh.shape[a] for a in ("data", "fsdp", "context", "expert")])
    n = np.prod([mesh.shape[a] for a in split.split("+")])
    local = V * D * 4 / mesh.shape.get("tensor", 1)  # the table's rows on this device, f32
    want = {
        # the group's token ids, once (the backward's gather is the forward's to XLA); this
        # device's tokens' rows, every D slice of them, forward and back
        (split, "all-gather"): n * tokens * 4,
        (split, "all-to-all"): 2 * tokens * D * 4,
    }
    if summed:  # other tokens for the same slice, on other devices: the slice's sum
        want[(summed, "all-reduce")] = local / n
    if "tensor" in mesh.shape and mesh.shape["tensor"] > 1:
        # rows split over `tensor`: each device's lookup is zero outside its own, summed
        want[("tensor", "all-reduce")] = tokens * D * 4
    # The loss's own sum over the tokens' devices is a scalar (4 bytes): not the lookup's.
    got = {k: r["bytes"] for k, r in rows.items() if r["bytes"] > 4}
    assert got == want, rows


def test_routed_only_where_it_sends_fewer_bytes():
    """Routed: 2 M tokens' rows each way; gathered: the table once a step and its gradient M
    times, (M + 1) rows. On fsdp=8 with 64 rows a device, 56 tokens a device route in a step
    of one microbatch (112 < 128 rows sent) but not of two (224 > 192); 40 route in both."""
    shape = {"pipeline": 1, "data": 1, "fsdp": 8, "context": 1, "expert": 1, "tensor": 1}

    def routed(tokens: int, microbatches: int) -> bool:
        shape_BT = (8, tokens)  # 8 rows over fsdp=8: `tokens` a device
        return routing(RULES, shape, (V, D), shape_BT, TABLE, microbatches) is not None

    assert routed(56, 1) and not routed(56, 2)
    assert routed(40, 1) and routed(40, 2)
    assert not routed(64, 1)  # as many tokens as rows: the gathered path
    # 4 rows do not split over fsdp=8: a shard_map needs whole blocks, so gathered.
    assert routing(RULES, shape, (V, D), (4, 4), TABLE, 1) is None


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
