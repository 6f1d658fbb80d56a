"""Mixture of experts: dispatch over the expert axis equals every-expert-on-every-token, the
dropped fraction is what the router's choices imply, and checkpoints move across expert
layouts."""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.checkpoint.store import Checkpointer, param_shapes
from jaxdist.config import DataConfig
from jaxdist.data import TokenBatches
from jaxdist.layout import Layout
from jaxdist.parallel import dropless
from jaxdist.parallel.experts import capacity, dispatch_rows, moe_ffn
from jaxdist.rules import activation_rules
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from tests.helpers import compiled_for, mesh_for

STEPS = 3
E, K, D, F, B, T = 8, 2, 16, 32, 16, 8


def _inputs(skewed=False, seed=0):
    """Tokens, router choices (K distinct experts each) and weights; `skewed`: most tokens
    choose the low experts, so the devices holding those are sent far more than their share."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    if skewed:
        expert = np.minimum(rng.geometric(0.35, size=(B, T, K)) - 1, E - 1).astype(np.int32)
    else:
        expert = rng.integers(0, E, size=(B, T, K)).astype(np.int32)
    expert[..., 1] = np.where(
        expert[..., 1] == expert[..., 0], (expert[..., 0] + 1) % E, expert[..., 1]
    )
    weight = rng.uniform(size=(B, T, K)).astype(np.float32)
    w_up, w_gate = (rng.normal(size=(E, D, F)).astype(np.float32) / 4 for _ in range(2))
    w_down = rng.normal(size=(E, F, D)).astype(np.float32) / 4
    return x, expert, weight, w_up, w_gate, w_down


def _dense(x, expert, weight, w_up, w_gate, w_down):
    """Every expert on every token, masked by the router (models/moe.py's dense reference)."""
    h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, w_gate)) * jnp.einsum("btd,edf->btef", x, w_up)
    out = jnp.einsum("btef,efd->bted", h, w_down)
    mix = jnp.sum(jax.nn.one_hot(expert, E) * weight[..., None], axis=2)
    return jnp.einsum("bted,bte->btd", out, mix, precision="highest")


def _moe_on(layout, args, capacity_factor=None, buffer_factor=1.25):
    """moe_ffn on `layout` (tokens over the batch axes, experts over `expert`, their width over
    `tensor`): (y, stats, the gradient of sum(y * y) by x and the weights)."""
    mesh = mesh_for(layout)
    tok = NamedSharding(mesh, P(("data", "fsdp", "expert")))
    w_in = NamedSharding(mesh, P("expert", "fsdp", "tensor"))
    w_out = NamedSharding(mesh, P("expert", "tensor", "fsdp"))

    def f(x, expert, weight, w_up, w_gate, w_down):
        with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
            return moe_ffn(x, expert, weight, w_up, w_gate, w_down, capacity_factor, buffer_factor)

    def loss(x, w_up, w_gate, w_down, expert, weight):
        y, _ = f(x, expert, weight, w_up, w_gate, w_down)
        return jnp.sum(y * y)

    shardings = (tok, tok, tok, w_in, w_in, w_out)
    placed = [jax.device_put(a, s) for a, s in zip(args, shardings, strict=True)]
    y, stats = jax.jit(f)(*placed)
    x, expert, weight, w_up, w_gate, w_down = placed
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w_up, w_gate, w_down, expert, weight)
    return np.asarray(y), jax.device_get(stats), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("layout", ["single", "expert=4,data=2", "expert=2,fsdp=2,tensor=2"])
def test_dropless_equals_dense_reference(layout):
    # A receive buffer that holds every peer's rows: nothing can be dropped (the bound's
    # overflow has its own test).
    args = _inputs()
    y, stats, grads = _moe_on(layout, args, buffer_factor=4.0)
    np.testing.assert_allclose(y, _dense(*args), rtol=1e-5, atol=1e-5)
    assert float(stats["dropped"]) == 0 and float(stats["assigned"]) == B * T * K
    np.testing.assert_array_equal(stats["load_E"], np.bincount(args[1].reshape(-1), minlength=E))
    x, expert, weight, w_up, w_gate, w_down = (jnp.asarray(a) for a in args)

    def dense_loss(x, w_up, w_gate, w_down):
        y = _dense(x, expert, weight, w_up, w_gate, w_down)
        return jnp.sum(y * y)

    ref = jax.grad(dense_loss, argnums=(0, 1, 2, 3))(x, w_up, w_gate, w_down)
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(g, np.asarray(r), rtol=1e-4, atol=1e-4)


def test_dropless_overflow_is_counted_exactly():
    # Skewed routing onto 4 devices of 2 experts each, with a receive buffer of 1.25 x the
    # balanced share: the devices of the low experts overflow. Independently: each device's
    # tokens go in chunks (dropless.chunks: here its two rows), and for each chunk each device
    # keeps the first R / chunks rows of its buffer in (local expert, source device) order.
    args = _inputs(skewed=True)
    y, stats, _ = _moe_on("expert=4,data=2", args)
    expert = args[1]
    n_dev, n_ep, e = 8, 4, E // 4
    rows = B // n_dev * T  # tokens per device
    h = dropless.chunks(rows, n_ep)
    assert h == 2
    R = dispatch_rows(rows, E, K, n_ep, None)
    assert R == h * int(1.25 * rows // h * K)
    # Devices d = 4 * data + expert: each expert group of 4 devices exchanges among itself.
    assign = expert.reshape(n_dev, h, rows // h * K)  # device, chunk, token-major assignments
    counts = np.stack([[np.bincount(a, minlength=E) for a in d] for d in assign])
    dropped, kept = 0, np.zeros((n_dev, h, E), int)  # kept[source, chunk, expert]
    for chunk in range(h):
        for group in range(n_dev // n_ep):
            sources = range(group * n_ep, (group + 1) * n_ep)
            for peer in range(n_ep):
                room = R // h
                for j in range(e):
                    for s in sources:
                        c = counts[s, chunk, peer * e + j]
                        kept[s, chunk, peer * e + j] = min(c, room)
                        dropped += c - kept[s, chunk, peer * e + j]
                        room -= kept[s, chunk, peer * e + j]
    assert dropped > 0  # the case is meant to overflow
    assert float(stats["dropped"]) == dropped
    np.testing.assert_array_equal(stats["load_E"], counts.sum((0, 1)))
    # A token's choice whose row was dropped contributes nothing: the dense reference with those
    # choices' weights zeroed. Rows of one (source, chunk, expert) slice are kept in token order.
    x, expert, weight, *w = args
    weight = weight.copy()
    per_chunk = rows // h * K
    for s in range(n_dev):
        for chunk in range(h):
            seen = np.zeros(E, int)
            for i, ex in enumerate(assign[s, chunk]):
                if seen[ex] >= kept[s, chunk, ex]:
                    a = chunk * per_chunk + i  # the device's assignment: token * K + choice
                    weight[s * 2 + a // (T * K), a // K % T, a % K] = 0
                seen[ex] += 1
    np.testing.assert_allclose(y, _dense(x, expert, weight, *w), rtol=1e-5, atol=1e-5)


def test_dropless_bound_large_enough_drops_nothing():
    args = _inputs(skewed=True)
    y, stats, _ = _moe_on("expert=4,data=2", args, buffer_factor=4.0)
    assert float(stats["dropped"]) == 0
    np.testing.assert_allclose(y, _dense(*args), rtol=1e-5, atol=1e-5)


@functools.cache
def _run(layout, **moe):
    """STEPS steps of tiny-moe on `layout`, made once per module: (losses, final state,
    metrics per step)."""
    mc, mesh, c = compiled_for(layout, "tiny-moe", steps=STEPS, **moe)
    data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
    state, losses, metrics = c.init_fn(), [], []
    for s in range(STEPS):
        state, m = c.step_fn(state, jax.device_put(data.batch(s), c.batch_sharding))
        losses.append(float(m["loss"]))
        metrics.append({k: float(v) for k, v in m.items()})
    return losses, state, metrics


@pytest.fixture(scope="module")
def dense_reference():
    return _run("single", moe_impl="dense")


# Capacity factor E/K = 4 gives each expert as many slots as a device has tokens: nothing is
# dropped; dropless with a receive buffer of 2x the balanced share on 2 expert devices holds
# every row a device can be sent: nothing is dropped either. Each mode runs on one layout. The
# layouts: experts beside a data axis, and beside FSDP and tensor (expert weights gathered over
# fsdp, their MLP width split over tensor). The quick loop keeps the second.
@pytest.mark.parametrize(
    "layout, mode",
    [
        pytest.param("expert=4,data=2", {"capacity_factor": 4.0}, marks=pytest.mark.slow),
        ("expert=2,fsdp=2,tensor=2", {"moe_buffer_factor": 2.0}),
    ],
    ids=["capacity4-expert=4,data=2", "dropless-expert=2,fsdp=2,tensor=2"],
)
def test_expert_parallel_equals_dense_reference(dense_reference, layout, mode):
    ref_losses, ref_state, _ = dense_reference
    losses, state, metrics = _run(layout, **mode)
    assert all(m["moe_dropped"] == 0 for m in metrics)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    params, ref_params = jax.device_get(state.params), jax.device_get(ref_state.params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_dropped_fraction_matches_the_router_choices():
    mesh = mesh_for("expert=4,data=2")
    E, K, D, F, B, T, cf = 8, 2, 16, 32, 16, 8, 0.5
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    # Skewed routing so that some experts overflow their capacity.
    expert = np.minimum(rng.geometric(0.35, size=(B, T, K)) - 1, E - 1).astype(np.int32)
    expert[..., 1] = np.where(
        expert[..., 1] == expert[..., 0], (expert[..., 0] + 1) % E, expert[..., 1]
    )
    weight = np.full((B, T, K), 0.5, np.float32)
    w_up, w_gate = (rng.normal(size=(E, D, F)).astype(np.float32) for _ in range(2))
    w_down = rng.normal(size=(E, F, D)).astype(np.float32)
    tok = NamedSharding(mesh, P(("data", "fsdp", "expert")))
    ew = NamedSharding(mesh, P("expert"))

    @jax.jit
    def run(x, expert, weight, w_up, w_gate, w_down):
        with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
            return moe_ffn(x, expert, weight, w_up, w_gate, w_down, cf)

    _, stats = run(
        *(
            jax.device_put(a, s)
            for a, s in zip(
                (x, expert, weight, w_up, w_gate, w_down), (tok, tok, tok, ew, ew, ew), strict=True
            )
        )
    )

    # Independently: 8 devices hold 2 rows each; per device, each expert takes the first C
    # assignments in priority order (every token's first choice before any second choice).
    per_device = B // 8
    C = capacity(per_device * T, E, K, cf)
    dropped = 0
    for d in range(8):
        rows = expert[d * per_device : (d + 1) * per_device].reshape(-1, K)
        taken = np.zeros(E, int)
        for k in range(K):
            for e in rows[:, k]:
                if taken[e] < C:
                    taken[e] += 1
                else:
                    dropped += 1
    assert dropped > 0  # the case is meant to overflow
    assert float(stats["dropped"]) == dropped
    assert float(stats["assigned"]) == B * T * K
    np.testing.assert_array_equal(
        np.asarray(stats["load_E"]), np.bincount(expert.reshape(-1), minlength=E)
    )


def test_checkpoint_moves_across_expert_layouts(tmp_path):
    # The quick case's trained state (compiled once), onto two other expert layouts: restoring
    # compiles no step.
    src = "expert=2,fsdp=2,tensor=2"
    state = _run(src, moe_buffer_factor=2.0)[1]
    _, _, a = compiled_for(src, "tiny-moe")
    saved = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
    ck = Checkpointer(tmp_path)
    ck.save(0, state, {"param_shapes": param_shapes(a.abstract_state.params), "mesh": {}})
    ck.close()
    for layout in ("expert=8", "expert=4,data=2"):
        _, mesh, b = compiled_for(layout, "tiny-moe")
        r = Checkpointer(tmp_path).restore_latest(
            b.abstract_state, param_shapes(b.abstract_state.params)
        )
        for x, y in zip(jax.tree.leaves(jax.device_get(r.state)), saved, strict=True):
            np.testing.assert_array_equal(np.asarray(x), y)
        w = r.state.params["w_up_LEDF"][...]
        assert w.sharding.mesh.shape["expert"] == mesh.shape["expert"]
        assert w.addressable_shards[0].data.shape[1] * mesh.shape["expert"] == 8


def test_moe_active_flops_and_bad_input(capsys):
    from jaxdist.cli.main import main

    c = get_model_config("tiny-moe")
    dense_like = get_model_config("tiny-moe", num_experts=c.top_k, top_k=c.top_k)
    # Active parameters only: the same as a 2-expert model, but for the larger router.
    router_extra = 6 * c.num_layers * c.d_model * (c.num_experts - c.top_k)
    assert c.flops_per_token() == dense_like.flops_per_token() + router_extra
    bad = [
        (
            [
                "--model",
                "tiny-moe",
                "--mesh",
                "expert=8",
                "--devices",
                "cpu:8",
                "--capacity-factor",
                "0",
            ],
            "capacity factor 0.0 must be > 0",
        ),
        (
            ["--model", "tiny", "--devices", "cpu:8", "--capacity-factor", "2"],
            "apply to MoE models",
        ),
        (
            ["--model", "tiny-moe", "--devices", "cpu:8", "--moe-buffer-factor", "0.5"],
            "--moe-buffer-factor: 0.5 must be at least 1",
        ),
    ]
    for args, message in bad:
        # In this process: both end in setup, before anything compiles.
        assert main(["train", "--steps", "1", "--compile-cache", "off", *args]) == 2
        err = capsys.readouterr().err
        assert message in err, err
    with pytest.raises(Exception, match="top-k 9 must lie in"):
        get_model_config("tiny-moe", top_k=9)


def test_experts_not_divisible_by_the_expert_axis():
    from jaxdist.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"'expert' of size 6 is not divisible by mesh axes "
        r"expert \(size 4\)",
    ):
        compiled_for("expert=4,data=2", "tiny-moe", num_experts=6)


@pytest.mark.slow
def test_profile_attributes_all_to_all_to_the_expert_axis(tmp_path, monkeypatch, capsys):
    import json

    from jaxdist.cli.main import main

    # In this process: its 8 fake CPU devices, its compile cache, XLA:CPU's op-level trace
    # events already on (tests/conftest.py). setup() appends its profiling flags to XLA_FLAGS,
    # read only when JAX starts: put back afterwards, for the subprocesses of later tests.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    args = ["--model", "tiny-moe", "--mesh", "expert=4,data=2", "--devices", "cpu:8"]
    args += ["--capacity-factor", "1.25"]  # capacity mode: its buffers' bytes are fixed
    # Step 0 compiles and step 1 runs warm; steps 2 and 3 are traced.
    run = ["--steps", "4", "--profile", "2:4", "--run-dir", str(tmp_path)]
    rc = main(["train", *args, *run, "--checkpoint-every", "100", "--compile-cache", "off"])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((tmp_path / "profile" / "breakdown.json").read_text())
    assert sorted({x["step"] for x in rep["steps"]}) == [2, 3]
    mc = get_model_config("tiny-moe")
    tokens = 16 // 8 * mc.seq_len  # rows per device x sequence
    C = capacity(tokens, mc.num_experts, mc.top_k, 1.25)
    per_layer = 4 * mc.num_experts * C * mc.d_model * 4  # 2 there and back, fwd and bwd, fp32
    for row in rep["steps"]:
        a2a = row["by_axis"]["expert"]["all-to-all"]
        assert a2a["bytes"] == mc.num_layers * per_layer and a2a["time_s"] > 0


def _ragged_all_to_all_by_doc(operand, output, in_off, send, out_off, recv, *, axis_name):
    """jax.lax.ragged_all_to_all as its docstring defines it, from an all-to-all (XLA:CPU has
    no ragged one): slice i of `operand` goes to peer i // (slices per peer), written at
    out_off[i] there; what a peer is not sent keeps `output`'s value."""
    n = jax.lax.psum(1, axis_name)
    rows, M = operand.shape[0], output.shape[0]
    r = jnp.arange(rows)
    in_slice_Nr = (r >= in_off[:, None]) & (r < (in_off + send)[:, None])
    slice_r = jnp.argmax(in_slice_Nr, axis=0)
    sent_r = in_slice_Nr.any(0)
    peer_r = slice_r // (in_off.shape[0] // n)
    pos_r = jnp.where(sent_r, out_off[slice_r] + r - in_off[slice_r], M)
    block = jnp.zeros((n, M, *operand.shape[1:]), operand.dtype)
    block = block.at[peer_r, pos_r].set(operand, mode="drop")
    mask = jnp.zeros((n, M), bool).at[peer_r, pos_r].set(True, mode="drop")
    got = jax.lax.all_to_all(block, axis_name, 0, 0, tiled=True).sum(0)
    hit = jax.lax.all_to_all(mask, axis_name, 0, 0, tiled=True).any(0)
    return jnp.where(hit.reshape(M, *(1,) * (operand.ndim - 1)), got, output)


@pytest.mark.parametrize("factor", [1.25, 4.0])
def test_ragged_exchange_equals_the_cpu_one(monkeypatch, factor):
    # The path TPUs and GPUs take (offsets, sizes and the ragged exchange), run here with the
    # ragged all-to-all built as its docstring defines it: the same outputs, drops and
    # gradients as the path XLA:CPU takes, with and without rows past the bound.
    from jaxdist.parallel import dropless

    args = _inputs(skewed=True)
    blocks = _moe_on("expert=4,data=2", args, buffer_factor=factor)
    monkeypatch.setattr(dropless, "RAGGED_PLATFORMS", ("cpu",))
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_doc)
    ragged = _moe_on("expert=4,data=2", args, buffer_factor=factor)
    np.testing.assert_allclose(ragged[0], blocks[0], rtol=1e-6, atol=1e-6)
    assert float(ragged[1]["dropped"]) == float(blocks[1]["dropped"])
    assert (float(blocks[1]["dropped"]) > 0) == (factor < 4)
    for a, b in zip(ragged[2], blocks[2], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install 'jaxdist[tpu]')"
)
def test_dropless_compiles_for_tpu_with_ragged_all_to_all():
    # XLA:CPU cannot run a ragged all-to-all; the TPU compiler takes one from this host. Per
    # layer: out and back forward, their transposes backward, each the receive bound's rows
    # (1.25 x the balanced share) or the routed rows, whole: nothing padded to E x capacity.
    from jaxdist.compiled import hlo
    from jaxdist.compiled.tpu import parse_target, tpu_devices
    from jaxdist.mesh import build_mesh, parse_mesh

    mesh = build_mesh(parse_mesh("expert=4,data=2"), tpu_devices(parse_target("tpu-v5p:2x2x2")))
    s, D = jax.ShapeDtypeStruct, 128  # a whole TPU lane row: no padding in the bytes
    tok, w_in = NamedSharding(mesh, P(("data", "fsdp", "expert"))), NamedSharding(mesh, P("expert"))
    args = [
        s((B, T, D), np.float32, sharding=tok),
        s((B, T, K), np.int32, sharding=tok),
        s((B, T, K), np.float32, sharding=tok),
        *(s(shape, np.float32, sharding=w_in) for shape in ((E, D, F), (E, D, F), (E, F, D))),
    ]

    def loss(x, expert, weight, w_up, w_gate, w_down):
        with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
            y, _ = moe_ffn(x, expert, weight, w_up, w_gate, w_down, None)
        return jnp.sum(y * y)

    text = jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5))).lower(*args).compile().as_text()
    ragged = [c for c in hlo.collectives(text, dict(mesh.shape)) if c.kind == "ragged-all-to-all"]
    # Each chunk's exchange out and back, forward and transposed (dropless.chunks: 2).
    A = B // 8 * T * K // 2
    R = dispatch_rows(B // 8 * T, E, K, 4, None) // 2
    assert sorted(c.bytes for c in ragged) == sorted([R * D * 4, A * D * 4] * 2 * 2)
    assert all(c.axes == ("expert",) for c in ragged)
