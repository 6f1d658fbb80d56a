"""Rematerialization policies (models/remat.py): what each keeps of a layer for the backward pass,
counted from JAX's saved residuals against shapes worked out by hand; the same gradients as
keeping everything; and the recompute share each is priced at."""

import contextlib
import functools
import io
from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jaxdist.kernels.loss import Vocab
from jaxdist.layout import Layout
from jaxdist.rules import activation_rules
from jaxdist.step import forward_loss
from meshes.presets import STANDARD_RULES
from models import remat
from models.presets import get_model_config
from models.transformer import Transformer, TransformerConfig, _block
from models.transformer_config import RematPolicy
from tests.helpers import mesh_for

# One tiny-llama layer with splash attention at B=2 rows of T=256 on one device: D=128, N=4
# query heads in G=2 kv groups (n=2 each), H=32, F=384, fp32. T is not 128 so that the
# splash kernel's 128-lane log-sum-exp [.., T, 128] cannot pass for the sliced one [.., T].
QKV = "f32[2,256,2,4,32]"  # fused QKV, [B, T, G, N/G + 2, H]
KERNEL_OUT, LSE = "f32[2,2,2,256,32]", "f32[2,2,2,256]"  # splash's layout: [B, G, n, T, (H)]
BTD, BTF = "f32[2,256,128]", "f32[2,256,384]"
SAVED = {
    "full": [],
    # The output projection; the MLP's up and gate (SwiGLU); never the 128-lane statistics.
    "dots": [QKV, KERNEL_OUT, LSE, BTD, BTF, BTF],
    "dots_except_mlp": [QKV, KERNEL_OUT, LSE, BTD],
    "offload": [s.replace("f32[", "f32<host>[") for s in [QKV, KERNEL_OUT, LSE, BTD, BTF, BTF]],
}


def _saved(policy: str) -> list[str]:
    """The types of what one layer keeps for its backward pass (not its inputs or constants)."""
    c = get_model_config("tiny-llama", attention="splash", remat=policy, seq_len=256)
    w = {k: v[0] for k, v in Transformer(c, nnx.Rngs(0)).weights().items() if "_L" in k}
    x_BTD, positions_BT = jnp.ones((2, 256, 128)), jnp.arange(256)[None]
    mesh = mesh_for("single")

    def layer(x_BTD, w):
        with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
            block = jax.checkpoint(
                lambda x, w: _block(c, x, w, positions_BT, None)[0],
                policy=remat.POLICIES[policy],
            )
            return block(x_BTD, w).sum()

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(layer, x_BTD, w)
    lines = out.getvalue().splitlines()
    return sorted(s.split()[0] for s in lines if "from a constant" not in s and "argument" not in s)


@pytest.mark.parametrize("policy", sorted(SAVED))
def test_each_policy_saves_what_it_says(policy):
    assert _saved(policy) == sorted(SAVED[policy])


@functools.cache
def _value_and_grads(attention: str, policy: str):
    """The loss and its gradients through tiny-llama (scan over layers, sharded over every
    strategy at once) under one policy; each (attention, policy) compiled once per module."""
    mesh = mesh_for("data=2,fsdp=2,tensor=2")
    tokens = jax.random.randint(jax.random.key(1), (8, 129), 0, 40, jnp.int32)
    mc = get_model_config("tiny-llama", attention=attention, remat=policy)
    graphdef, params = nnx.split(Transformer(mc, nnx.Rngs(0)))

    def loss(params, tokens_BT1):
        with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
            model = nnx.merge(graphdef, params)
            return forward_loss(model, tokens_BT1, Vocab(None, 0), True, 8192)[0]

    return jax.jit(jax.value_and_grad(loss))(params, tokens)


# Every policy under splash (the kernel's residuals are what the policies name and keep);
# under XLA's attention (batched matmuls, never saved) dots and full, one that recomputes
# those matmuls and one that recomputes everything. dots_except_mlp and offload under XLA's
# attention take no branch the splash cases do not, and are a study (-m experiment).
REMAT_CASES = [
    pytest.param(attention, policy, marks=pytest.mark.experiment)
    if attention == "xla" and policy in ("dots_except_mlp", "offload")
    else (attention, policy)
    for attention in ("xla", "splash")
    for policy in remat.POLICIES
    if policy != "none"
]


@pytest.mark.slow
@pytest.mark.parametrize("attention, policy", REMAT_CASES)
def test_every_policy_has_the_gradients_of_keeping_everything(attention, policy):
    """The loss and its gradients are those of no remat, whatever the policy keeps or
    recomputes."""
    value, grads = _value_and_grads(attention, policy)
    ref_value, ref_grads = _value_and_grads(attention, "none")
    reference = dict(nnx.to_flat_state(ref_grads))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6, err_msg=policy)
    for name, g in nnx.to_flat_state(grads):
        np.testing.assert_allclose(
            g[...], reference[name][...], rtol=1e-4, atol=1e-6, err_msg=f"{policy} {name}"
        )


def test_recompute_shares_worked_by_hand():
    # Llama-2-7B: the MLP's 3 * D * F of 4 * D^2 + 3 * D * F matmul FLOPs per token and layer
    # (QKV 3 * D^2, output D^2): 3 * 11008 / (4 * 4096 + 3 * 11008) = 0.66839...
    llama = TransformerConfig("7b", "llama", 32, 4096, 32, 32, 11008, 32000, 2048)
    # Llama-3-8B's 8 kv heads shrink QKV to (32 + 16) * 128 * D: the MLP is 0.807 of it.
    gqa = TransformerConfig("8b", "llama", 32, 4096, 32, 8, 14336, 128256, 2048)
    gpt2 = TransformerConfig("124m", "gpt2", 12, 768, 12, 12, 3072, 50304, 1024)  # 8D^2/12D^2
    share = remat.RECOMPUTE["dots_except_mlp"]
    assert share(llama) == pytest.approx(33024 / 49408)
    assert share(gqa) == pytest.approx(3 * 14336 / (48 * 128 + 4096 + 3 * 14336))
    assert share(gpt2) == pytest.approx(2 / 3)
    assert [remat.RECOMPUTE[p](llama) for p in ("none", "dots", "offload", "full")] == [0, 0, 0, 1]


def test_order_lists_every_policy_but_offload_once():
    # offload's host copies are not priced by the planner: auto never picks it.
    assert sorted(remat.ORDER) == sorted(set(remat.POLICIES) - {"offload"})
    assert remat.ORDER[0] == "none" and remat.ORDER[-1] == "full"


def test_the_flags_name_every_policy_and_only_those():
    """The config's and the flags' policy names (read without jax) are the policies' keys."""
    assert set(get_args(RematPolicy)) == set(remat.POLICIES)
