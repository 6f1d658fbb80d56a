"""The command line end to end: tokenize for a Hugging Face model, fine-tune from it
(--init-from), export the run (export-hf), generate from it; and transformers itself loading
the export, where a reference Python with torch and transformers is at hand.

The reference Python is $JAXDIST_HF_REFERENCE_PYTHON (.ci/run makes one when it can: Python 3.11
with a CPU build of torch and transformers). Without it, the test that needs it skips, saying
so; the fixture-based tests (tests/test_hf.py) always run."""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

from jaxdist.cli.main import main
from jaxdist.hf.source import check, load
from meshes.presets import STANDARD_RULES
from models.hf_family import FAMILY
from tests.helpers import cli, losses, mesh_for
from tests.test_hf import FIX, logits_of

MESH = "data=2,fsdp=2,tensor=2"
COMMON = ["--devices", "cpu:8", "--mesh", MESH]
_LIVE = """
import sys, numpy as np, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ids = torch.tensor(np.load(sys.argv[2]))
with torch.no_grad():
    np.save(sys.argv[3], model(ids).logits.numpy())
print(type(model).__name__)
"""


def reference_python() -> str | None:
    found = os.environ.get("JAXDIST_HF_REFERENCE_PYTHON")
    if not found or not pathlib.Path(found).is_file():
        return None
    probe = subprocess.run([found, "-c", "import torch, transformers"], capture_output=True)
    return found if probe.returncode == 0 else None


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _tokenized(tmp: pathlib.Path, name: str, text: str) -> pathlib.Path:
    """`text` 200 times, tokenized with fixture `name`'s tokenizer: the data directory."""
    corpus, data = tmp / "corpus.txt", tmp / "data"
    corpus.write_text(text * 200)
    tokenizer = FIX / name / "tokenizer.json"
    _ok(cli("tokenize", "--input", str(corpus), "--out", str(data), "--tokenizer", str(tokenizer)))
    return data


def _init_from(name: str, data: pathlib.Path) -> list[str]:
    """`train` from fixture `name`'s weights on `data`: 8 rows of 32 tokens on MESH."""
    return [
        "train", "--init-from", f"hf:{FIX / name}", "--data", str(data), "--batch-size", "8",
        "--seq-len", "32", "--mesh", MESH,
    ]  # fmt: skip


def _run_source(run: pathlib.Path, step: int | None = None):
    """The run's parameters on MESH, loaded as generate and export-hf load them."""
    return load(check(str(run), FAMILY), mesh_for(MESH), STANDARD_RULES, "float32", step)


def _transformers_agrees(python: str, export, run, vocab: int, seed: int, tmp) -> str:
    """transformers loads `export` and computes, for random ids, the logits we compute from
    the run's checkpoint; returns the class transformers chose."""
    ids = np.random.default_rng(seed).integers(0, vocab, size=(8, 16))
    np.save(tmp / "ids.npy", ids)
    res = subprocess.run(
        [python, "-c", _LIVE, str(export), str(tmp / "ids.npy"), str(tmp / "theirs.npy")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    src = _run_source(run)
    ours = logits_of(src.config, src.mesh, src.params, ids)[..., :vocab]
    np.testing.assert_allclose(np.load(tmp / "theirs.npy"), ours, atol=1e-4, rtol=0)
    return res.stdout.split()[-1]


@pytest.fixture(scope="module", params=["llama-gqa", "gpt2"])
def fine_tuned(request, tmp_path_factory):
    """A run fine-tuned 3 steps from a fixture model, and its export."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    data = _tokenized(tmp, name, "def main(args):\n    return [arg for arg in args]\n")
    run = tmp / "run"
    _ok(
        cli(*_init_from(name, data), "--steps", "3", "--run-dir", str(run), "--lr", "1e-2", *COMMON)
    )
    out = json.loads(_ok(cli("export-hf", str(run), str(tmp / "export"), *COMMON)).splitlines()[-1])
    return name, tmp, run, tmp / "export", out


@pytest.mark.slow
def test_init_from_records_source_and_starts_at_step_zero(fine_tuned):
    name, _, run, _, _ = fine_tuned
    record = json.loads((run / "config.json").read_text())
    assert record["init_from"]["path"] == str((FIX / name).absolute())
    assert record["init_from"]["architecture"] in ("LlamaForCausalLM", "GPT2LMHeadModel")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r][0] == 0


@pytest.mark.slow
def test_export_and_generate_from_the_run(fine_tuned):
    name, tmp, run, export, out = fine_tuned
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(
        out["files"]
    )
    # Fine-tuning changed the weights: the export is the run's, not the source's.
    assert (export / "model.safetensors").read_bytes() != (
        FIX / name / "model.safetensors"
    ).read_bytes()
    res = cli(
        "generate", str(run), "--prompt", "def main(args):", "--max-new-tokens", "8",
        "--json", "--devices", "cpu:8", "--mesh", "data=4,tensor=2",
    )  # fmt: skip
    got = json.loads(_ok(res).splitlines()[-1])
    assert set(got) == {"prompt_ids", "new_ids", "text", "tokens_per_s"}
    assert 1 <= len(got["new_ids"]) <= 8 and all(0 <= i < 300 for i in got["new_ids"])
    assert got["tokens_per_s"] > 0


@pytest.fixture(scope="module")  # the scope of fine_tuned, so that it is set up first
def python():
    """The reference Python, or a skip saying why (before any run is trained for the test)."""
    found = reference_python()
    if found is None:
        pytest.skip(
            "no reference Python with torch and transformers (JAXDIST_HF_REFERENCE_PYTHON, "
            "which .ci/run sets when it can); tests/test_hf.py covers import and generation"
        )
    return found


@pytest.mark.slow
def test_transformers_loads_export_with_our_logits(python, fine_tuned):
    name, tmp, run, export, _ = fine_tuned
    chosen = _transformers_agrees(python, export, run, 300, 1, tmp)
    assert chosen == ("GPT2LMHeadModel" if name == "gpt2" else "LlamaForCausalLM")


def test_init_from_refuses_data_of_another_tokenizer(tmp_path, capsys):
    argv = [
        "train", "--init-from", f"hf:{FIX / 'gpt2'}", "--steps", "1", "--devices", "cpu:8",
        "--compile-cache", "off", "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    assert main(argv) == 2
    assert "not tokenized with the model's tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_transformers_loads_export_of_a_run_from_scratch(python, tmp_path):
    """A preset trained here, with no Hugging Face source: GPT-2 style without biases (zeros
    in the export) and an untied head. (Llama-style exports: the fine-tuned run above.)"""
    run, export = tmp_path / "run", tmp_path / "export"
    _ok(
        cli(
            "train",
            "--model",
            "tiny",
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--run-dir",
            str(run),
            *COMMON,
        )
    )
    _ok(cli("export-hf", str(run), str(export), "--dtype", "float32", *COMMON))
    assert _transformers_agrees(python, export, run, 256, 2, tmp_path) == "GPT2LMHeadModel"


@pytest.mark.slow
def test_model_hf_is_the_architecture_randomly_initialized(tmp_path):
    run = tmp_path / "run"
    _ok(
        cli(
            "train", "--model", f"hf:{FIX / 'gpt2'}", "--steps", "2", "--batch-size", "8",
            "--run-dir", str(run), *COMMON,
        )
    )  # fmt: skip
    record = json.loads((run / "config.json").read_text())
    assert "init_from" not in record
    model = record["model"]
    assert (model["style"], model["d_model"], model["num_layers"], model["vocab_size"]) == (
        "gpt2",
        32,
        2,
        384,
    )
    assert model["tie_embeddings"] and model["attention_bias"] and model["mlp_bias"]
    # Random init (std 0.02), not the fixture's weights (drawn with std 0.2), two small steps on.
    embed = np.asarray(_run_source(run).params["tok_embed_VD"])[:300]
    assert 0.01 < embed.std() < 0.05


@pytest.mark.slow
def test_init_from_run_resumes_from_its_own_checkpoint(tmp_path):
    data = _tokenized(tmp_path, "llama-tied", "def main(args):\n    return args\n")
    train = [
        *_init_from("llama-tied", data), "--run-dir", str(tmp_path / "run"), "--devices",
        "cpu:8", "--log-every", "1", "--checkpoint-every", "2",
    ]  # fmt: skip
    _ok(cli(*train, "--steps", "2"))
    res = cli(*train, "--steps", "4")
    _ok(res)
    assert "resuming from checkpoint step 1" in res.stderr
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in logged if "loss" in r}) == [0, 1, 2, 3]


@pytest.mark.slow
def test_init_from_on_two_processes_matches_one(tmp_path):
    """Each process reads only its own devices' slices; the run is the one-process run."""
    text = "class Reader:\n    def read(self):\n        return self.path\n"
    train = [*_init_from("llama-gqa", _tokenized(tmp_path, "llama-gqa", text)), "--steps", "3"]
    train += ["--log-every", "1"]
    launch = ["launch", "--processes", "2", "--devices-per-process", "4", "--"]
    _ok(cli(*launch, *train, "--run-dir", str(tmp_path / "two")))
    _ok(cli(*train, "--devices", "cpu:8", "--run-dir", str(tmp_path / "one")))
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(two) == [0, 1, 2]
    np.testing.assert_allclose([two[s] for s in range(3)], [one[s] for s in range(3)], rtol=1e-5)


@pytest.mark.slow
def test_export_of_a_given_step(fine_tuned, capsys):
    from jaxdist.errors import ConfigError

    _, tmp, run, export, _ = fine_tuned
    with pytest.raises(ConfigError, match=r"no checkpoint of step 7; it has \[0, 2\]"):
        _run_source(run, step=7)
    out = tmp / f"export-step-2-{os.getpid()}"
    _ok(
        cli(
            "export-hf", str(run), str(out), "--step", "2", "--devices", "cpu:8", "--mesh", "fsdp=8"
        )
    )
    assert (out / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()
    assert main(["export-hf", str(run), str(out), "--devices", "cpu:8"]) == 2
    assert "exists" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_hf_model_from_the_command_line():
    """As the README runs it: the prompt through the model's tokenizer, transformers' tokens."""
    from tests.test_hf import reference

    versions = json.loads((FIX / "versions.json").read_text())
    ref = reference("llama-tied")
    res = cli(
        "generate", f"hf:{FIX / 'llama-tied'}", "--prompt", versions["prompt"],
        "--max-new-tokens", "32", "--json", "--devices", "cpu:8", "--mesh", "data=4,tensor=2",
    )  # fmt: skip
    got = json.loads(_ok(res).splitlines()[-1])
    assert got["prompt_ids"] == ref["prompt_ids"].tolist()
    assert got["new_ids"] == ref["greedy_ids"].tolist()
    res = cli("generate", f"hf:{FIX / 'llama-tied'}", "--prompt", "def", "--devices", "cpu:8")
    out = _ok(res)
    assert out.startswith("def") and out.strip().splitlines()[-1].endswith(" tokens/s]")
