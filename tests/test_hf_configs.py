"""Hugging Face config.json files read as ours: RoPE scaling against transformers' own
frequencies (tests/fixtures/hf/rope_frequencies.json, written by tests/make_hf_fixtures.py),
each architecture's options and refusals, EOS as the model's files declare it, and the
published architectures named in models/configs/."""

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

from jaxdist.data.tokenizer import Tokenizer, load
from jaxdist.errors import ConfigError
from jaxdist.hf.source import eos_ids
from models import hf, rope
from models.hf_config import hf_architecture
from models.presets import from_record, get_model_config
from tests.test_hf import FIX, MODELS, load_on, logits_of, reference


def _config(name: str) -> dict:
    return json.loads((FIX / name / "config.json").read_text())


def test_rope_frequencies_equal_transformers():
    cases = json.loads((FIX / "rope_frequencies.json").read_text())
    kinds = set()
    for case in cases:
        hf_config = case["config"]
        theta, scaling = rope.from_hf(hf_config, "case")
        kinds.add(dict(scaling).get("rope_type", "default"))
        H = (
            hf_config.get("head_dim")
            or hf_config["hidden_size"] // hf_config["num_attention_heads"]
        )
        ours = rope.inv_freq(theta, scaling, H)
        np.testing.assert_allclose(ours, case["inv_freq"], rtol=1e-6, err_msg=str(hf_config))
        assert rope.attention_scale(scaling) == pytest.approx(case["attention_factor"])
    assert kinds == {"llama3", "linear", "dynamic", "yarn"}
    # Llama 3.1's scaling changes the low frequencies (by up to its factor, 8), not the high.
    meta = cases[0]
    plain = rope.inv_freq(500000.0, (), 128)
    ratio = plain / np.asarray(meta["inv_freq"])
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(8.0)


def test_both_rope_spellings_read_alike():
    new = _config("llama31")  # transformers 5: rope_parameters, rope_theta inside
    params = dict(new["rope_parameters"])
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = {"type": params.pop("rope_type"), **params}  # Llama 3.1's own files
    assert hf.config_from_hf(old, "x", "x") == hf.config_from_hf(new, "x", "x")
    assert hf.config_from_hf(new, "x", "x")[0].rope_scaling[0] == ("rope_type", "llama3")


def test_unsupported_rope_is_refused_in_one_line():
    c = {**_config("llama-gqa"), "rope_parameters": {"rope_type": "longrope", "factor": 2.0}}
    with pytest.raises(ConfigError, match="RoPE type 'longrope' is not supported; supported: def"):
        hf.config_from_hf(c, "x", "where")
    c["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(ConfigError, match="needs low_freq_factor, high_freq_factor, original_max"):
        hf.config_from_hf(c, "x", "where")


def test_dynamic_rope_only_within_its_original_context():
    c = {**_config("llama-gqa"), "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
    config, _ = hf.config_from_hf(c, "x", "x")  # 64 positions: the plain frequencies
    np.testing.assert_array_equal(
        rope.inv_freq(config.rope_theta, config.rope_scaling, 8),
        rope.inv_freq(config.rope_theta, (), 8),
    )
    with pytest.raises(ConfigError, match="dynamic RoPE scaling is supported up to .*64 tokens"):
        dataclasses.replace(config, seq_len=128)


def test_sliding_window_only_where_it_covers_the_context(tmp_path):
    d = pathlib.Path(shutil.copytree(FIX / "mistral", tmp_path / "mistral"))
    assert hf.open_model(d).config.seq_len == 64  # window 64 = the context: accepted
    (d / "config.json").write_text(json.dumps({**_config("mistral"), "sliding_window": 32}))
    assert hf.open_model(d).config.seq_len == 32  # the longest full attention equals
    assert get_model_config(f"hf:{d}", seq_len=16).seq_len == 16
    with pytest.raises(ConfigError, match="sliding-window attention is not supported.*32 tokens"):
        get_model_config(f"hf:{d}", seq_len=64)
    # Qwen2 names a window it does not use unless use_sliding_window is on.
    qwen = {**_config("qwen2"), "sliding_window": 16, "use_sliding_window": False}
    assert hf.config_from_hf(qwen, "x", "x")[0].seq_len == 64
    on = hf.config_from_hf({**qwen, "use_sliding_window": True}, "x", "x")[0]
    assert (on.seq_len, on.sliding_window) == (16, 16)


def test_each_architecture_as_ours():
    def of(name):
        return hf.open_model(FIX / name).config

    qwen2, qwen3, mixtral, qmoe = of("qwen2"), of("qwen3"), of("mixtral"), of("qwen3-moe")
    assert (qwen2.attention_bias, qwen2.out_bias, qwen2.tie_embeddings) == (True, False, True)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.d_model, qwen3.num_heads) == (True, 16, 32, 4)
    assert (mixtral.num_experts, mixtral.top_k, mixtral.d_mlp, mixtral.moe_renormalize) == (
        4,
        2,
        48,
        True,
    )
    assert (qmoe.num_experts, qmoe.d_mlp, qmoe.moe_renormalize, qmoe.qk_norm) == (
        4,
        24,
        False,
        True,
    )
    # Each exports as its own architecture.
    for name in MODELS:
        arch = _config(name)["architectures"][0]
        assert hf_architecture(of(name), arch) == arch, name


def test_qwen3_moe_with_dense_layers_is_refused():
    c = _config("qwen3-moe")
    for bad in ({"decoder_sparse_step": 2}, {"mlp_only_layers": [0]}):
        with pytest.raises(ConfigError, match="every layer must be MoE"):
            hf.config_from_hf({**c, **bad}, "x", "x")


@pytest.mark.slow
def test_mixtral_dispatch_without_drops_equals_transformers():
    ref = reference("mixtral")
    model, mesh, params = load_on("mixtral", "data=2,expert=2,tensor=2")
    config = dataclasses.replace(model.config, moe_impl="dispatch", moe_buffer_factor=2.0)
    ids = np.tile(ref["input_ids"], (4, 1))
    # logits_of computes MoE dense; this is the dispatch path, experts over the expert axis.
    logits = logits_of(config, mesh, params, ids, dense_moe=False)[:2]
    np.testing.assert_allclose(logits[..., :300], ref["logits"], atol=1e-4, rtol=0)


def test_head_dim_follows_the_width_unless_set():
    tiny = get_model_config("tiny-llama", d_model=256)
    assert (tiny.head_dim, tiny.head_dim_override) == (64, 0)  # 256 / 4, not the preset's 32
    qwen3 = hf.open_model(FIX / "qwen3").config
    padding = (384 - 300) * 32 * 2  # the padded vocabulary's rows, embedding and head
    assert qwen3.num_params() == sum(v.size for v in _weights("qwen3").values()) + padding


def _weights(name: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(FIX / name / "model.safetensors"))


def test_a_recorded_config_loads_back():
    c = hf.open_model(FIX / "llama31").config
    recorded = json.loads(json.dumps(dataclasses.asdict(c)))  # as a run's config.json holds it
    assert from_record(recorded) == c and hash(from_record(recorded)) == hash(c)
    older = {k: v for k, v in recorded.items() if k not in ("rope_scaling", "qk_norm")}
    older |= {"rope_theta": 10000.0}
    assert from_record(older).rope_scaling == ()  # a record from before these fields


def test_eos_comes_from_the_model_files(tmp_path):
    # <|im_end|> is no name jaxdist guesses: the tokenizer alone has no EOS.
    text = (FIX / "qwen3" / "tokenizer.json").read_text()
    with pytest.raises(ConfigError, match="declares no EOS beside it"):
        Tokenizer(text, "qwen3")
    assert load(FIX / "qwen3" / "tokenizer.json").eos_id == 0  # tokenizer_config.json's
    gen = json.loads((FIX / "qwen3" / "generation_config.json").read_text())["eos_token_id"]
    assert len(gen) == 2 and eos_ids(_config("qwen3"), FIX / "qwen3") == tuple(gen)
    for name in MODELS:
        if name != "qwen3":
            assert eos_ids(_config(name), FIX / name) == (0,), name
    # Without eos_token_id anywhere: tokenizer_config.json's eos_token; without that, none.
    d = pathlib.Path(shutil.copytree(FIX / "qwen3", tmp_path / "qwen3"))
    for f in ("config.json", "generation_config.json"):
        c = json.loads((d / f).read_text())
        (d / f).write_text(json.dumps({k: v for k, v in c.items() if k != "eos_token_id"}))
    assert eos_ids(json.loads((d / "config.json").read_text()), d) == (0,)
    (d / "tokenizer_config.json").unlink()
    assert eos_ids(json.loads((d / "config.json").read_text()), d) == ()


# Published sizes: parameter counts as their authors give them (8.03B, 70.6B, 405.9B, 46.7B,
# 6.74B), to the parameter.
PUBLISHED = {
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 131072, 8_030_261_248),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 131072, 70_553_706_496),
    "llama3-405b": (126, 16384, 128, 8, 53248, 128256, 131072, 405_853_388_800),
    "mixtral-8x7b": (32, 4096, 32, 8, 14336, 32000, 32768, 46_702_792_704),
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000, 4096, 6_738_415_616),
}


# Published sizes quoted rounded, each checked to half a unit of its last digit: Qwen3-30B-A3B
# "30.5B in total" (its model card), DeepSeek-V3 "671B total parameters" (arXiv:2412.19437,
# the main model: its multi-token-prediction module's 14B apart, as jaxdist skips it).
ROUNDED = {"qwen3-30b-a3b": (30.5e9, 0.05e9), "deepseek-v3": (671e9, 0.5e9)}


@pytest.mark.parametrize("name", list(ROUNDED))
def test_named_moe_configs_have_their_published_sizes(name):
    c = get_model_config(name)
    quoted, half_unit = ROUNDED[name]
    assert abs(c.num_params() - quoted) <= half_unit, c.num_params()
    assert c.capacity_factor is None  # dropless, as both were trained


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_named_configs_are_the_published_architectures(name):
    c = get_model_config(name)
    sizes = (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.d_mlp, c.vocab_size)
    assert (*sizes, c.seq_len, c.num_params()) == PUBLISHED[name]
    if name.startswith("llama3"):
        assert dict(c.rope_scaling) == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        assert c.rope_theta == 500000.0
    assert get_model_config(name, seq_len=2048).seq_len == 2048
