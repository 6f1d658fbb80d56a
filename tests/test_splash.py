"""Splash attention (jaxdist.kernels.attention, the TPU kernel) equals XLA's attention: run in
Pallas interpret mode on the CPU mesh, outputs and gradients, plain and packed rows; and compiled
for a TPU v5p slice from this host, the 1b step has no [.., T, T] tensor and half the memory."""

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.compiled import tpu
from jaxdist.kernels.documents import from_tokens
from jaxdist.kernels.loss import Vocab
from jaxdist.layout import Layout
from jaxdist.parallel import attention as attn
from jaxdist.rules import activation_rules
from jaxdist.step import forward_loss
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config
from models.transformer import Transformer
from tests.extras import needs_tpu
from tests.helpers import CLI_ENV, JAXDIST, mesh_for


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_splash_equals_xla_attention_outputs_and_grads(packed):
    # 4 rows over data x fsdp, 4 query heads in 2 kv groups over tensor; T = 256 in blocks of
    # 512 clipped to T, and documents that start at random EOS ids (0) when packed.
    B, T, N, G, H = 4, 256, 4, 2, 32
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k = jax.random.normal(keys[1], (B, T, G, H))
    v = jax.random.normal(keys[2], (B, T, G, H))
    docs = from_tokens(jax.random.randint(keys[3], (B, T), 0, 16), 0) if packed else None
    w = jax.random.normal(keys[4], (B, T, N, H))  # a cotangent with no symmetry to hide behind
    mesh = mesh_for("data=2,fsdp=2,tensor=2")

    def run(implementation):
        def f(q, k, v):
            with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
                mask = attn.document_mask(implementation, docs) if packed else None
                o = attn.attention(q, k, v, mask, implementation)
            return jnp.sum(o * w), o

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, o_xla), g_xla = run("xla")
    (_, o_splash), g_splash = run("splash")
    np.testing.assert_allclose(o_splash, o_xla, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_splash, g_xla, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_model_with_splash_attention_trains_as_with_xla():
    """The whole loss and its gradients through the model (scan over layers, remat keeping
    the kernel's output, packed documents), sharded over every strategy at once."""
    mesh = mesh_for("data=2,fsdp=2,tensor=2")
    tokens = jax.random.randint(jax.random.key(1), (8, 129), 0, 40, jnp.int32)
    out = {}
    for impl in ("xla", "splash"):
        mc = get_model_config("tiny-llama", attention=impl, remat="dots")
        graphdef, params = nnx.split(Transformer(mc, nnx.Rngs(0)))

        def loss(params, tokens_BT1, graphdef=graphdef):
            with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
                model = nnx.merge(graphdef, params)
                return forward_loss(model, tokens_BT1, Vocab(None, 0), True, 8192)[0]

        out[impl] = jax.jit(jax.value_and_grad(loss))(params, tokens)
    np.testing.assert_allclose(out["splash"][0], out["xla"][0], rtol=1e-5)
    flat = dict(nnx.to_flat_state(out["xla"][1]))
    for name, g in nnx.to_flat_state(out["splash"][1]):
        np.testing.assert_allclose(g[...], flat[name][...], rtol=1e-3, atol=1e-5, err_msg=str(name))


# -m experiment (30 s; the suite's time): the suite keeps splash against XLA attention, and
# against it across a context split, and the pipeline against no pipeline with XLA's.
@pytest.mark.experiment
def test_splash_attention_inside_the_pipeline_trains_as_xla_unpipelined():
    # Inside the pipeline's shard_map the batch axes are manual already: splash splits only
    # the heads there (rules.shard_map_here). Same losses as XLA's attention without a pipeline.
    from jaxdist.config import DataConfig, OptimConfig
    from jaxdist.data import TokenBatches
    from jaxdist.layout import Layout, StepConfig
    from jaxdist.optim import make_optimizer
    from jaxdist.step import build

    def losses(layout, kernel):
        mc = get_model_config("tiny-llama", attention=kernel, num_layers=4)
        tx, lr = make_optimizer(OptimConfig(warmup_steps=2), 3)
        mesh = mesh_for(layout)
        at = Layout.on(mesh, STANDARD_RULES, StepConfig(4), batch_size=16, seq_len=mc.seq_len)
        c = build(lambda r: Transformer(mc, r), tx, lr, at, mesh)
        data = TokenBatches(DataConfig(batch_size=16), mc.seq_len, mc.vocab_size)
        state, out = c.init_fn(), []
        for s in range(2):
            state, m = c.step_fn(state, jax.device_put(data.batch(s), c.batch_sharding))
            out.append(float(m["loss"]))
        return out

    np.testing.assert_allclose(
        losses("pipeline=2,data=2,tensor=2", "splash"),
        losses("data=2,fsdp=2,tensor=2", "xla"),
        rtol=1e-5,
    )


TPU_1B = [
    "--model",
    "1b",
    "--mesh",
    "fsdp=4",
    "--batch-size",
    "16",
    "--compile-only",
    "--json",
    "-",
]
# The preset's remat named: `auto` may keep everything, the norms' fp32 [L, B, T, D] values
# among it, which at D = T = 2048 are shaped like attention scores.
TPU_1B += ["--target", "tpu-v5p:2x2x1", "--remat", "dots"]


@pytest.fixture(scope="module", autouse=True)
def tpu_compile(request, tmp_path_factory):
    """The 1b step compiled for the TPU (its own process: most of a minute of XLA's TPU
    compiler) starts with the module's first test and runs beside the CPU ones; the test that
    reads it, the module's last, waits for it. Its stdout and stderr files and the process;
    None where that test is not selected or libtpu is missing."""
    name = "test_1b_on_tpu_v5p_runs_splash_attention_in_half_the_memory"
    selected = any(
        getattr(i, "module", None) is request.module and getattr(i, "originalname", "") == name
        for i in request.session.items
    )
    if not selected or tpu.missing():
        yield None
        return
    out = tmp_path_factory.mktemp("tpu_1b")
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [*JAXDIST, "train", *TPU_1B], stdout=stdout, stderr=stderr, env=CLI_ENV
        )
    yield out / "stdout", out / "stderr", proc
    if proc.poll() is None:  # its test was not reached
        proc.kill()
    proc.wait()


# A memory study of the 1b preset on the TPU compiler (27 s): -m experiment, for the suite's time.
@pytest.mark.experiment
@needs_tpu
def test_1b_on_tpu_v5p_runs_splash_attention_in_half_the_memory(tpu_compile):
    stdout, stderr, proc = tpu_compile
    assert proc.wait(timeout=1200) == 0, stderr.read_text()[-3000:]
    report = json.loads(stdout.read_text().strip().splitlines()[-1])
    k = report["kernels"]
    # Splash's forward, dq and dkv kernels: the forward runs once (remat keeps its output).
    assert k["attention"]["tpu_custom_calls"] == 3
    assert report["attention_kernel"] == "splash (Pallas kernel)"
    assert k["score_tensors"] == 0  # no [.., 2048, 2048] value anywhere in the program
    # XLA's attention needed 57.5 GB per chip here; the bar is half of it.
    assert report["per_device_bytes"]["peak_estimate"] <= 28e9
    assert report["warnings"] == []
