"""Hugging Face import, export and generation against transformers' own outputs.

The references (tests/fixtures/hf, made by tests/make_hf_fixtures.py with transformers: see
versions.json there) are tiny random LlamaForCausalLM (grouped-query: untied; tied with 4 heads
per group; with attention and MLP biases; Llama 3.1's RoPE scaling), GPT2LMHeadModel,
Qwen2ForCausalLM, Qwen3ForCausalLM (its EOS <|im_end|>, a second one in generation_config.json),
MistralForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM (its shared
expert gated) and DeepseekV3ForCausalLM (latent attention with q_lora_rank, interleaved yarn RoPE
and mscale; without, as DeepSeek-V2-Lite; every layer dense; and a dense first layer then MoE
layers of DeepSeek's routing: sigmoid scores, 4 groups, a random selection bias, a shared expert)
models, their fp32 logits for
fixed ids and their greedy generations. MoE models are compared computing every expert
(moe_impl dense), as transformers does: dispatch's capacity would drop tokens."""

import dataclasses
import functools
import json
import math
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxdist.cli.main import main
from jaxdist.errors import ConfigError
from jaxdist.hf.export import export
from jaxdist.hf.generation import generation_mesh, run_generation
from jaxdist.hf.safetensors_io import SafetensorsDir
from jaxdist.hf.source import Source, check, eos_ids
from jaxdist.inference.generate import SampleConfig, pick
from jaxdist.layout import Layout
from jaxdist.rules import activation_rules, state_shardings
from meshes.presets import STANDARD_RULES
from models import hf
from models.hf_adapter import ADAPTER
from models.transformer import Transformer
from tests.helpers import mesh_for

FIX = pathlib.Path(__file__).parent / "fixtures" / "hf"
MODELS = ["llama-gqa", "llama-tied", "llama-bias", "gpt2"]
MODELS += ["llama31", "qwen2", "qwen3", "mistral", "mixtral", "qwen3-moe", "qwen2-moe"]
MODELS += ["deepseek-v3", "deepseek-v3-lite", "deepseek-v3-moe"]
SLOW = pytest.mark.slow


def reference(name: str) -> dict[str, np.ndarray]:
    return load_file(str(FIX / name / "reference.safetensors"))


def load_on(name_or_path, layout: str):
    """A fixture model read into `layout`'s sharded arrays: (model, mesh, params dict)."""
    path = FIX / name_or_path if isinstance(name_or_path, str) else name_or_path
    model = hf.open_model(path)
    mesh = mesh_for(layout)
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(model.config, nnx.Rngs(0))))
    shardings = state_shardings(abstract, STANDARD_RULES, mesh)
    by_path = dict(jax.tree_util.tree_flatten_with_path(shardings)[0])
    targets = {
        path[0].key: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=by_path[path])
        for path, a in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    return model, mesh, hf.load(model, targets)


def logits_of(config, mesh, params, ids: np.ndarray, dense_moe: bool = True) -> np.ndarray:
    if config.num_experts and dense_moe:  # every token to its experts, nothing dropped
        config = dataclasses.replace(config, moe_impl="dense")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0))))
    state = jax.tree_util.tree_map_with_path(lambda p, _: params[p[0].key], abstract)

    @jax.jit
    def forward(state, ids):
        with activation_rules(Layout.on(mesh, STANDARD_RULES), mesh):
            return nnx.merge(graphdef, state)(ids)[0]

    return np.asarray(forward(state, jnp.asarray(ids, jnp.int32)))


# Every architecture on the mesh of every strategy at once (each case compiles its forward);
# on one axis of 8 the suite keeps a dense and a mixture-of-experts model each: the weights
# replicated (data=8: llama-gqa, mixtral) and sharded eight ways (fsdp=8: gpt2, qwen3-moe).
# The other 16 are a study (-m experiment).
ONE_AXIS = {"data=8": ("llama-gqa", "mixtral"), "fsdp=8": ("gpt2", "qwen3-moe")}


def _logit_cases():
    cases = []
    for name in MODELS:
        for layout, suite in ONE_AXIS.items():
            marks = SLOW if name in suite else pytest.mark.experiment
            cases.append(pytest.param(name, layout, marks=marks))
        cases.append(pytest.param(name, "data=2,fsdp=2,tensor=2"))
    return cases


@pytest.mark.parametrize("name, layout", _logit_cases())
def test_imported_logits_equal_transformers(name, layout):
    ref = reference(name)
    model, mesh, params = load_on(name, layout)
    # Each parameter is laid out as the rules say for this mesh, not replicated by default.
    assert params["tok_embed_VD"].sharding.spec == STANDARD_RULES.spec(("vocab", "embed"), "param")
    ids = np.tile(ref["input_ids"], (4, 1))  # 8 rows: one per device of the batch axes
    logits = logits_of(model.config, mesh, params, ids)[:2]
    V = model.vocab_size
    assert logits.shape[-1] == model.config.vocab_size > V  # padded to a multiple of 128
    np.testing.assert_allclose(logits[..., :V], ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-lite", "deepseek-v3-moe"])
def test_latent_attention_logits_within_1e5_of_transformers(name):
    """The issue's bound for DeepSeek-V3 (float32), its heads split four ways (one a device)."""
    ref = reference(name)
    model, mesh, params = load_on(name, "fsdp=2,tensor=4")
    assert model.config.mla and "wkv_b_LCNX" in params and "wqkv_LDGQH" not in params
    assert ("wq_b_LRNU" in params) == (name != "deepseek-v3-lite")
    logits = logits_of(model.config, mesh, params, np.tile(ref["input_ids"], (4, 1)))[:2]
    np.testing.assert_allclose(logits[..., :300], ref["logits"], atol=1e-5, rtol=0)


def test_deepseek_moe_reads_its_routing_and_dense_first_layers():
    c = hf.open_model(FIX / "deepseek-v3-moe").config
    assert (c.dense_layers, c.dense_d_mlp, c.num_experts, c.top_k, c.d_mlp) == (1, 80, 8, 2, 16)
    assert (c.scoring, c.n_group, c.topk_group, c.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert c.router_bias and c.moe_renormalize and c.shared_width == 16
    params = _source("deepseek-v3-moe")[1].params
    bias = load_file(str(FIX / "deepseek-v3-moe" / "model.safetensors"))
    want = bias["model.layers.2.mlp.gate.e_score_correction_bias"]
    np.testing.assert_array_equal(np.asarray(params["expert_bias_LE"])[1], want)
    assert params["dense_w_up_LDF"].shape == (1, 32, 80) and params["w_up_LEDF"].shape[0] == 2


def test_deepseek_dense_first_layers_below_zero_are_refused(tmp_path):
    """At or past the layers every layer is dense, as transformers reads it (deepseek-v3-lite
    says 2 of its 1); below zero is refused."""
    d = _copy("deepseek-v3-moe", tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "first_k_dense_replace": -1}))
    with pytest.raises(ConfigError, match=r"first_k_dense_replace -1 must be >= 0"):
        hf.open_model(d)


def _params_host(params: dict) -> dict:
    return {k: np.asarray(jax.device_get(v)) for k, v in params.items()}


@functools.cache
def _source(name: str, layout: str = "data=2,fsdp=2,tensor=2"):
    """One import per fixture model for the module: the tests read its arrays, never change
    them (generation donates its cache only)."""
    model, mesh, params = load_on(name, layout)
    stops = eos_ids(model.hf_config, model.path)
    src = Source(
        spec=model.spec,
        params=params,
        mesh=mesh,
        rules=STANDARD_RULES,
        compute_dtype="float32",
        vocab_size=model.vocab_size,
        eos_id=stops[0],
        tokenizer=model.path / "tokenizer.json",
        hf_config=model.hf_config,
        source_dir=model.path,
        dtype="float32",
        adapter=ADAPTER,
        eos_ids=stops,
    )
    return model, src


def _tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(directory.glob("model*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            out |= {k: st.get_tensor(k) for k in st.keys()}
    return out


@pytest.mark.parametrize("name", MODELS)
def test_export_of_import_is_bitwise(name, tmp_path):
    _, src = _source(name)
    files = export(src, tmp_path / "out", None, 1 << 30)
    assert "model.safetensors" in files and "config.json" in files
    original, exported = _tensors(FIX / name), _tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and exported[k].shape == v.shape, k
        assert exported[k].tobytes() == v.tobytes(), k
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    src_config = json.loads((FIX / name / "config.json").read_text())
    for key in ("architectures", "vocab_size", "tie_word_embeddings", "eos_token_id"):
        assert config[key] == src_config[key], key
    for f in ("tokenizer.json", "generation_config.json", "tokenizer_config.json"):
        if (FIX / name / f).is_file():
            assert (tmp_path / "out" / f).read_bytes() == (FIX / name / f).read_bytes()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_sharded_export_reimports(tmp_path):
    """Past the shard size: several files and an index, which import reads back."""
    _, src = _source("llama-gqa")
    files = export(src, tmp_path / "out", "bfloat16", 40_000)
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    exported = _tensors(tmp_path / "out")
    assert {str(v.dtype) for v in exported.values()} == {"bfloat16"}
    # What a run started from this directory records, and exports in by default.
    assert SafetensorsDir(tmp_path / "out").dtype() == "bfloat16"
    _, _, params = load_on(tmp_path / "out", "fsdp=8")
    original = _params_host(src.params)
    for k, v in _params_host(params).items():
        want = original[k].astype(jnp.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(v, want, err_msg=k)


# llama-gqa and qwen3 (EOS from its config, two of them) stay in the quick loop; each other
# architecture compiles its own two programs.
QUICK = ("llama-gqa", "qwen3", "deepseek-v3")


@pytest.mark.parametrize("name", [m if m in QUICK else pytest.param(m, marks=SLOW) for m in MODELS])
def test_greedy_generate_equals_transformers(name):
    ref = reference(name)
    _, src = _source(name)
    prompt = ref["prompt_ids"].tolist()
    out = run_generation(src, prompt, SampleConfig(max_new_tokens=32))
    assert out.new_ids == ref["greedy_ids"].tolist()
    assert out.tokens_per_s > 0


@SLOW  # two generations, the second compiled for the whole context
def test_generation_stops_after_eos_and_at_the_context():
    ref = reference("llama-gqa")
    _, src = _source("llama-gqa")
    prompt, greedy = ref["prompt_ids"].tolist(), ref["greedy_ids"].tolist()
    eos = greedy[5]  # as if this token were EOS: generation ends with it, as transformers' does
    out = run_generation(src._replace(eos_id=eos), prompt, SampleConfig(32))
    assert out.new_ids == greedy[: greedy.index(eos) + 1]
    out = run_generation(src, prompt, SampleConfig(max_new_tokens=500))
    assert len(out.new_ids) == 64 - len(prompt)  # the fixture's context is 64
    assert out.new_ids[:32] == greedy


@SLOW  # three generations, each compiled
def test_sampling_is_seeded_and_never_padded():
    _, src = _source("gpt2")
    prompt = reference("gpt2")["prompt_ids"].tolist()
    runs = [
        run_generation(src, prompt, SampleConfig(16, 1.5, top_k, seed)).new_ids
        for top_k, seed in ((None, 1), (None, 1), (None, 2))
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert all(0 <= i < src.vocab_size for r in runs for i in r)


def test_top_k_samples_among_the_k_most_likely():
    logits = jnp.tile(jnp.arange(384.0) / 50, (512, 1))  # id 383 likeliest, then 382, ...
    ids = pick(logits, 300, SampleConfig(temperature=1.0, top_k=3), jax.random.key(1))
    assert set(np.asarray(ids).tolist()) == {297, 298, 299}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pick_never_gives_a_padded_id(temperature):
    logits = jnp.zeros((64, 384)).at[:, 300:].set(100.0).at[:, 7].set(1.0)
    ids = pick(logits, 300, SampleConfig(temperature=temperature), jax.random.key(0))
    assert int(ids.max()) < 300
    if temperature == 0:
        assert set(np.asarray(ids).tolist()) == {7}


# --- bad input: one clear message each, before anything is loaded or compiled ---


def _copy(name: str, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(FIX / name, tmp_path / name))


def test_unsupported_architecture_is_named(tmp_path):
    d = _copy("llama-gqa", tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["GptOssForCausalLM"]}))
    with pytest.raises(ConfigError, match="'GptOssForCausalLM' is not supported; supported: L"):
        hf.open_model(d)


def test_missing_weight_files(tmp_path):
    d = _copy("gpt2", tmp_path)
    (d / "model.safetensors").unlink()
    # config.json alone is an architecture (plan, compile, train from scratch), as for Llama;
    # its weights are asked for only where they are read.
    assert hf.open_model(d).config.style == "gpt2"
    with pytest.raises(ConfigError, match="holds no weights"):
        SafetensorsDir(d)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ConfigError, match="model-00001-of-00002.safetensors.*missing"):
        hf.open_model(d)


def test_weight_shape_disagreeing_with_config(tmp_path):
    d = _copy("llama-gqa", tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ConfigError, match=r"gate_proj.weight has shape \[80, 32\].*\[96, 32\]"):
        load_on(d, "data=2,fsdp=2,tensor=2")


def test_missing_and_unknown_weights(tmp_path):
    d = _copy("llama-tied", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match="layers.1.mlp.up_proj.weight is missing"):
        load_on(d, "fsdp=8")
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((80, 32), np.float32)
    tensors["model.layers.1.mlp.extra.weight"] = np.zeros((3,), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match="extra.weight are not part of"):
        load_on(d, "fsdp=8")


def test_run_dir_without_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        check(str(tmp_path), ADAPTER)


def test_prompt_longer_than_context(capsys):
    argv = ["generate", f"hf:{FIX / 'gpt2'}", "--prompt", "return " * 80, "--devices", "cpu:8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # one line, naming cause and fix
    assert re.match(r"jaxdist: error: the prompt is \d+ tokens.*context is 64.*shorten", err)


def test_each_device_reads_only_its_shard(monkeypatch):
    """fsdp=8 splits every tensor of this model 8 ways: the import reads each element of the
    file once in all (not a whole tensor per device), each read exactly a device's block."""
    from jaxdist.hf import safetensors_io

    reads = []
    original = safetensors_io.SafetensorsDir.read

    def counting(self, name, index):
        block = original(self, name, index)
        reads.append((name, block.nbytes))
        return block

    monkeypatch.setattr(safetensors_io.SafetensorsDir, "read", counting)
    model, _, params = load_on("llama-gqa", "fsdp=8")
    file_bytes = sum(v.nbytes for v in _tensors(FIX / "llama-gqa").values())
    assert sum(n for _, n in reads) == file_bytes
    largest = max(math.prod(x.shape) for x in params.values()) * 4
    assert max(n for _, n in reads) <= largest // 8


def test_gpt2_without_prefix_and_with_mask_buffers(tmp_path):
    """The original GPT-2 checkpoints: names without "transformer.", and attention-mask buffers."""
    d = _copy("gpt2", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    renamed["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    save_file(renamed, str(d / "model.safetensors"))
    ref = reference("gpt2")
    model, mesh, params = load_on(d, "data=2,fsdp=2,tensor=2")
    assert model.prefix == ""
    logits = logits_of(model.config, mesh, params, np.tile(ref["input_ids"], (4, 1)))[:2]
    np.testing.assert_allclose(logits[..., :300], ref["logits"], atol=1e-4, rtol=0)


def test_models_without_a_hugging_face_form_are_refused():
    from models import decode
    from models.presets import get_model_config

    moe = get_model_config("tiny-moe")  # exports as Mixtral: a router and 3 tensors an expert
    names = [p.name(0) for p in hf.export_pieces(moe, 256)[0]]
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in names
    assert len([n for n in names if ".experts." in n]) == 8 * 3
    with pytest.raises(ConfigError, match="GPT-2 style mixture-of-experts"):
        hf.export_pieces(dataclasses.replace(moe, style="gpt2"), 256)
    with pytest.raises(ConfigError, match="moe_impl dense"):
        decode.check(moe)  # dispatch's capacity could drop a token's experts
    gqa_gpt2 = get_model_config("tiny", num_kv_heads=2)
    with pytest.raises(ConfigError, match="no GPT2LMHeadModel form"):
        hf.export_pieces(gqa_gpt2, 256)


def test_generation_mesh_splits_kv_heads_then_data():
    assert generation_mesh(check(f"hf:{FIX / 'llama-gqa'}", ADAPTER), "cpu:8") == "data=4,tensor=2"
    assert generation_mesh(check(f"hf:{FIX / 'gpt2'}", ADAPTER), "cpu:8") == "data=2,tensor=4"
