"""Latent attention's sizes (models/mla.py): its parameters counted as transformers' checkpoint
holds them, its FLOPs, the planner's view of it, and the configs it refuses. Its numbers against
transformers: tests/test_hf.py (deepseek-v3 fixtures); sharded against one device:
tests/test_equivalence.py."""

import math
import pathlib

import pytest
from safetensors import safe_open

from jaxdist.errors import ConfigError
from jaxdist.planning.compute import work_of
from jaxdist.planning.inputs import PlanConfig
from jaxdist.planning.planner import price
from meshes.presets import STANDARD_RULES
from models import hf
from models.inventory import plan_model
from models.presets import get_model_config

FIX = pathlib.Path(__file__).parent / "fixtures" / "hf"
MLA = dict(num_kv_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16)
MLA |= dict(qk_rope_head_dim=16, v_head_dim=24, rope_interleave=True)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-lite"])
def test_parameters_are_the_checkpoints_with_the_vocabulary_padded(name):
    c = hf.open_model(FIX / name).config
    with safe_open(str(FIX / name / "model.safetensors"), framework="numpy") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert c.num_params() == stored + 2 * (c.vocab_size - 300) * c.d_model  # embedding and head


def test_flops_count_the_latent_projections_and_both_attention_widths():
    c = get_model_config("tiny-llama", **MLA)
    L, D, N, F, V, T = c.num_layers, c.d_model, c.num_heads, c.d_mlp, c.vocab_size, c.seq_len
    attention = D * 48 + 48 * N * 32 + D * (32 + 16) + 32 * N * (16 + 24) + N * 24 * D
    weights = L * (attention + 3 * D * F) + D * V
    assert c.flops_per_token() == 6 * weights + 12 * L * N * (32 + 24) / 2 * T


def test_planner_prices_latent_attention_as_matmuls():
    model = plan_model(get_model_config("tiny-llama", compute_dtype="bfloat16", **MLA))
    work = work_of(model)
    D = model.d_model
    # Every weight matmul of the layers: the four attention ones and the down-projections
    # (wq_a, wkv_a), the output projection, the MLP's three; and the head.
    layer = [m for m in work.matmuls if m.in_layers]
    assert len(layer) == 5 + 3
    assert sum(m.weights for m in layer) == 2 * (
        D * 48 + 48 * 4 * 32 + D * 48 + 32 * 4 * 40 + 4 * 24 * D + 3 * D * 384
    )
    row = price({"fsdp": 2, "tensor": 2}, [model], STANDARD_RULES, PlanConfig(4, "h100", 16))
    assert row["fits"] and row["comm_s"] > 0


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(num_kv_heads=2), "one kv head per query head"),
        (dict(v_head_dim=40), "v_head_dim 40 must lie in"),
        (dict(qk_rope_head_dim=7), "must be even"),
        (dict(attention_bias=True), "attention biases"),
    ],
)
def test_latent_attention_configs_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        get_model_config("tiny-llama", **(MLA | over))
