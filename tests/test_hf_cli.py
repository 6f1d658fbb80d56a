"""The command line end to end: tokenize for a Hugging Face model, fine-tune from it
(--init-from), export the run (export-hf), generate from it; and transformers itself loading
the export, where a reference Python with torch and transformers is at hand.

The reference Python is $JAXDIST_HF_REFERENCE_PYTHON (.ci/run makes one when it can: Python 3.11
with a CPU build of torch and transformers). Without it, the test that needs it skips, saying
so; the fixture-based tests (tests/test_hf.py) always run.

The commands run in this process (its 8 fake CPU devices and compile cache), as `jaxdist`
would run them; only the two-process run starts processes of its own."""

import contextlib
import io
import json
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from jaxdist.cli.main import main
from jaxdist.hf.source import check, load
from meshes.presets import STANDARD_RULES
from models.hf_adapter import ADAPTER
from tests.extras import TORCH_REFERENCE_MISSING, TORCH_REFERENCE_VAR, torch_reference
from tests.helpers import losses, mesh_for
from tests.test_hf import FIX, logits_of

MESH = "data=2,fsdp=2,tensor=2"
COMMON = ["--devices", "cpu:8", "--mesh", MESH]
# transformers loads each export (lines on stdin: the export, the ids, where to save the
# logits) in one process, started before the exports exist: importing torch and transformers
# costs more than the three models, and runs meanwhile.
_LIVE = """
import sys, numpy as np, torch, transformers
for line in sys.stdin.read().splitlines():
    export, ids, out = line.split("\\t")
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    with torch.no_grad():
        np.save(out, model(torch.tensor(np.load(ids))).logits.numpy())
    print(type(model).__name__)
"""


def jaxdist(*args: str) -> tuple[str, str]:
    """`jaxdist *args` in this process: (stdout, stderr); it must exit 0."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    assert rc == 0, err.getvalue()[-3000:]
    return out.getvalue(), err.getvalue()


def _tokenized(tmp: pathlib.Path, name: str, text: str) -> pathlib.Path:
    """`text` 200 times, tokenized with fixture `name`'s tokenizer: the data directory."""
    corpus, data = tmp / "corpus.txt", tmp / "data"
    corpus.write_text(text * 200)
    tokenizer = FIX / name / "tokenizer.json"
    jaxdist("tokenize", "--input", str(corpus), "--out", str(data), "--tokenizer", str(tokenizer))
    return data


def _init_from(name: str, data: pathlib.Path) -> list[str]:
    """`train` from fixture `name`'s weights on `data`: 8 rows of 32 tokens on MESH."""
    return [
        "train", "--init-from", f"hf:{FIX / name}", "--data", str(data), "--batch-size", "8",
        "--seq-len", "32", "--mesh", MESH,
    ]  # fmt: skip


def _fine_tune_args(name: str, tmp: pathlib.Path) -> list[str]:
    """The fine-tuning run of fixture `name` (3 steps, each logged), but for its devices and
    run directory."""
    return [*_init_from(name, tmp / "data"), "--steps", "3", "--lr", "1e-2", "--log-every", "1"]


def _run_source(run: pathlib.Path, step: int | None = None):
    """The run's parameters on MESH, loaded as generate and export-hf load them."""
    return load(check(str(run), ADAPTER), mesh_for(MESH), STANDARD_RULES, "float32", step)


def _our_logits(run: pathlib.Path, ids: np.ndarray, vocab: int) -> np.ndarray:
    src = _run_source(run)
    return logits_of(src.spec.config, src.mesh, src.params, ids)[..., :vocab]


@pytest.fixture(scope="module")
def fine_tune(tmp_path_factory):
    """name -> (tmp, run, export, export-hf's JSON line): a run fine-tuned 3 steps from fixture
    `name`, and its export; made once, when first asked for, and shared by the tests."""
    made = {}

    def get(name: str):
        if name not in made:
            tmp = tmp_path_factory.mktemp(name)
            _tokenized(tmp, name, "def main(args):\n    return [arg for arg in args]\n")
            run, export = tmp / "run", tmp / "export"
            # Checkpoints before the last: auto saves only the last step of so short a run.
            args = [*_fine_tune_args(name, tmp), "--checkpoint-every", "1"]
            jaxdist(*args, "--devices", "cpu:8", "--run-dir", str(run))
            out, _ = jaxdist("export-hf", str(run), str(export), *COMMON)
            made[name] = tmp, run, export, json.loads(out.splitlines()[-1])
        return made[name]

    return get


@pytest.fixture(params=["llama-gqa", "gpt2"])
def fine_tuned(request, fine_tune):
    return request.param, *fine_tune(request.param)


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
    res, _ = jaxdist(
        "generate", str(run), "--prompt", "def main(args):", "--max-new-tokens", "8",
        "--json", "--devices", "cpu:8", "--mesh", "data=4,tensor=2",
    )  # fmt: skip
    got = json.loads(res.splitlines()[-1])
    assert set(got) == {"prompt_ids", "new_ids", "text", "tokens_per_s"}
    assert 1 <= len(got["new_ids"]) <= 8 and all(0 <= i < 300 for i in got["new_ids"])
    assert got["tokens_per_s"] > 0


@pytest.fixture(scope="module")  # module scope, so that it is set up before any run is made
def python():
    """The reference Python, or a skip saying why (before any run is trained for the test)."""
    found = torch_reference()
    if found is None:
        pytest.skip(f"{TORCH_REFERENCE_MISSING}; tests/test_hf.py covers import and generation")
    return found


@pytest.fixture(scope="module")
def from_scratch(tmp_path_factory):
    """A preset trained here, with no Hugging Face source (GPT-2 style without biases, zeros
    in the export, and an untied head), exported in float32: (run, export)."""
    tmp = tmp_path_factory.mktemp("scratch")
    run, export = tmp / "run", tmp / "export"
    train = ["train", "--model", "tiny", "--steps", "3", "--batch-size", "8"]
    jaxdist(*train, "--run-dir", str(run), *COMMON)
    jaxdist("export-hf", str(run), str(export), "--dtype", "float32", *COMMON)
    return run, export


class _Transformers:
    """transformers' logits of each export for random ids, from one process started before
    the exports are made and given them when first read."""

    def __init__(self, python: str, tmp: pathlib.Path):
        self.proc = subprocess.Popen(
            [python, "-c", _LIVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.ids, self._jobs, self._tmp, self._chosen = {}, [], tmp, None

    def add(self, key: str, export: pathlib.Path, vocab: int, seed: int) -> None:
        """Export `key` is to get random ids below `vocab`, drawn with `seed`."""
        self.ids[key] = np.random.default_rng(seed).integers(0, vocab, size=(8, 16))
        ids, out = self._tmp / f"{key}-ids.npy", self._tmp / f"{key}.npy"
        np.save(ids, self.ids[key])
        self._jobs.append((key, f"{export}\t{ids}\t{out}"))

    def result(self, key: str) -> tuple[str, np.ndarray]:
        """(the class transformers chose for export `key`, its logits)."""
        if self._chosen is None:
            jobs = "".join(line + "\n" for _, line in self._jobs)
            stdout, stderr = self.proc.communicate(jobs, timeout=600)
            assert self.proc.returncode == 0, f"{TORCH_REFERENCE_VAR}: {stderr[-3000:]}"
            keys = [k for k, _ in self._jobs]
            self._chosen = dict(zip(keys, stdout.split()[-len(keys) :], strict=True))
        return self._chosen[key], np.load(self._tmp / f"{key}.npy")


@pytest.fixture(scope="module")
def transformers_run(python, fine_tune, request, tmp_path_factory):
    """transformers on the two fine-tuned exports (300 ids) and the one from scratch (256),
    its process started first, to import while this one trains."""
    ref = _Transformers(python, tmp_path_factory.mktemp("transformers"))
    try:
        for name in ("llama-gqa", "gpt2"):
            ref.add(name, fine_tune(name)[2], 300, 1)
        ref.add("scratch", request.getfixturevalue("from_scratch")[1], 256, 2)
        yield ref
    finally:
        if ref.proc.poll() is None:  # a test failed before reading it
            ref.proc.kill()
            ref.proc.communicate()


@pytest.mark.slow
def test_transformers_loads_export_with_our_logits(transformers_run, fine_tuned):
    name, _, run, _, _ = fine_tuned
    ours = _our_logits(run, transformers_run.ids[name], 300)
    chosen, theirs = transformers_run.result(name)
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
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
def test_transformers_loads_export_of_a_run_from_scratch(transformers_run, from_scratch):
    """(Llama-style exports: the fine-tuned runs above.)"""
    ours = _our_logits(from_scratch[0], transformers_run.ids["scratch"], 256)
    chosen, theirs = transformers_run.result("scratch")
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    assert chosen == "GPT2LMHeadModel"


@pytest.mark.slow
def test_model_hf_is_the_architecture_randomly_initialized(fine_tune, tmp_path):
    # The gpt2 fine-tuning run's data and flags, --model for --init-from: its step compiled once.
    train = _fine_tune_args("gpt2", fine_tune("gpt2")[0])
    train[train.index("--init-from")] = "--model"
    run = tmp_path / "run"
    jaxdist(*train, "--devices", "cpu:8", "--run-dir", str(run))
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
    # Random init (std 0.02), not the fixture's weights (drawn with std 0.2), three small steps
    # on (warming up to 1e-2 over 20: 1.5e-3 in all).
    embed = np.asarray(_run_source(run).params["tok_embed_VD"])[:300]
    assert 0.01 < embed.std() < 0.05


@pytest.mark.slow
def test_init_from_run_resumes_from_its_own_checkpoint(fine_tune, tmp_path):
    """A copy of the fine-tuned run as if stopped after its first checkpoint (step 0; those of
    steps 1 and 2 removed), rerun with the same --init-from: it resumes from its own
    checkpoint, not the Hugging Face weights, and recomputes steps 1 and 2 bit for bit."""
    tmp, run, _, _ = fine_tune("llama-gqa")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert sorted(p.name for p in (copy / "checkpoints").iterdir() if p.name.isdigit()) == [
        "0",
        "1",
        "2",
    ]
    shutil.rmtree(copy / "checkpoints" / "1")
    shutil.rmtree(copy / "checkpoints" / "2")
    args = [*_fine_tune_args("llama-gqa", tmp), "--checkpoint-every", "1"]
    _, err = jaxdist(*args, "--devices", "cpu:8", "--run-dir", str(copy))
    assert "resuming from checkpoint step 0" in err
    logged = [json.loads(x) for x in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [0, 1, 2, 1, 2]
    assert losses(copy) == losses(run)


@pytest.mark.slow
def test_init_from_on_two_processes_matches_one(fine_tune):
    """Each process reads only its own devices' slices; the run is the one-process run (the
    fine-tuned llama-gqa run, on this process's 8 devices)."""
    tmp, one, _, _ = fine_tune("llama-gqa")
    launch = ["launch", "--processes", "2", "--devices-per-process", "4", "--"]
    # Saved at the end only (not also at step 0 to time a save): the losses do not depend on it.
    train = [*_fine_tune_args("llama-gqa", tmp), "--checkpoint-every", "3"]
    jaxdist(*launch, *train, "--run-dir", str(tmp / "two"))
    two, one = losses(tmp / "two"), losses(one)
    assert sorted(two) == sorted(one) == [0, 1, 2]
    np.testing.assert_allclose([two[s] for s in range(3)], [one[s] for s in range(3)], rtol=1e-5)


@pytest.mark.slow
def test_export_of_a_given_step(fine_tuned, capsys):
    from jaxdist.errors import ConfigError

    _, tmp, run, export, _ = fine_tuned
    with pytest.raises(ConfigError, match=r"no checkpoint of step 7; it has \[0, 1, 2\]"):
        _run_source(run, step=7)
    out = tmp / f"export-step-2-{os.getpid()}"
    jaxdist(
        "export-hf", str(run), str(out), "--step", "2", "--devices", "cpu:8", "--mesh", "fsdp=8"
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
    res, _ = jaxdist(
        "generate", f"hf:{FIX / 'llama-tied'}", "--prompt", versions["prompt"],
        "--max-new-tokens", "32", "--json", "--devices", "cpu:8", "--mesh", "data=4,tensor=2",
    )  # fmt: skip
    got = json.loads(res.splitlines()[-1])
    assert got["prompt_ids"] == ref["prompt_ids"].tolist()
    assert got["new_ids"] == ref["greedy_ids"].tolist()
    # As text, on the mesh chosen for it (data=4,tensor=2 again: the same programs).
    out, _ = jaxdist(
        "generate", f"hf:{FIX / 'llama-tied'}", "--prompt", versions["prompt"],
        "--max-new-tokens", "32", "--devices", "cpu:8",
    )  # fmt: skip
    assert out.startswith(versions["prompt"] + got["text"])
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"[{len(got['new_ids'])} tokens, ") and last.endswith(" tokens/s]")


# Each architecture's export of a model as a run from scratch would give it (no source
# config.json to start from: ours written whole), and llama31 as fine-tuned from its source.
ARCHITECTURES = ["llama31", "qwen2", "qwen3", "mistral", "mixtral", "qwen3-moe", "qwen2-moe"]
ARCHITECTURES += ["llama31-base", "deepseek-v3", "deepseek-v3-lite", "deepseek-v3-base"]
ARCHITECTURES += ["deepseek-v3-moe", "deepseek-v3-moe-base"]


@pytest.fixture(scope="module")
def transformers_exports(python, tmp_path_factory):
    from jaxdist.hf.export import export
    from tests.test_hf import _source

    tmp = tmp_path_factory.mktemp("architectures")
    ref = _Transformers(python, tmp_path_factory.mktemp("transformers-architectures"))
    try:
        for key in ARCHITECTURES:
            _, src = _source(key.removesuffix("-base"))
            if not key.endswith("-base"):
                src = src._replace(hf_config=None, source_dir=None)
            export(src, tmp / key, "float32", 1 << 30)
            ref.add(key, tmp / key, 300, 3)
        yield ref
    finally:
        if ref.proc.poll() is None:
            ref.proc.kill()
            ref.proc.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("key", ARCHITECTURES)
def test_transformers_loads_each_architecture_export(transformers_exports, key):
    from models.hf_config import hf_architecture
    from tests.test_hf import _source

    model, src = _source(key.removesuffix("-base"))
    config = src.spec.config
    ours = logits_of(config, src.mesh, src.params, transformers_exports.ids[key])[..., :300]
    chosen, theirs = transformers_exports.result(key)
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    base = model.architecture if key.endswith("-base") else None
    assert chosen == hf_architecture(config, base)
    assert chosen == model.architecture or key == "mistral"  # a window-less Mistral is a Llama


@pytest.mark.slow
def test_generate_stops_at_an_eos_the_model_declares():
    """qwen3's EOS is <|im_end|> (a name nothing guesses) and generation_config.json adds a
    second: transformers stopped at the second, after 8 tokens, and so does this."""
    from tests.test_hf import reference

    versions = json.loads((FIX / "versions.json").read_text())
    ref = reference("qwen3")
    res, _ = jaxdist(
        "generate", f"hf:{FIX / 'qwen3'}", "--prompt", versions["prompt"],
        "--max-new-tokens", "32", "--json", "--devices", "cpu:8", "--mesh", "data=4,tensor=2",
    )  # fmt: skip
    got = json.loads(res.splitlines()[-1])
    assert got["new_ids"] == ref["greedy_ids"].tolist() and len(got["new_ids"]) == 8
    stops = json.loads((FIX / "qwen3" / "generation_config.json").read_text())["eos_token_id"]
    assert got["new_ids"][-1] == stops[1] and stops[1] not in got["new_ids"][:-1]


@pytest.mark.slow
def test_the_export_of_a_run_on_bytes_generates_as_the_run_does(from_scratch):
    # A run on bytes (the default data) was exported without a tokenizer, and `generate` then
    # refused the directory. It now holds one whose ids are the bytes: the export continues a
    # prompt with the same ids as the run itself (greedy), and decodes them to the same text.
    run, export = from_scratch
    prompt = "def f(x):\n    return ünïcode "
    argv = ["--prompt", prompt, "--max-new-tokens", "6", "--json", "--devices", "cpu:8"]
    ours = json.loads(jaxdist("generate", str(run), *argv)[0].splitlines()[-1])
    theirs = json.loads(jaxdist("generate", f"hf:{export}", *argv)[0].splitlines()[-1])
    assert theirs["prompt_ids"] == ours["prompt_ids"] == list(prompt.encode())
    assert (theirs["new_ids"], theirs["text"]) == (ours["new_ids"], ours["text"])


@pytest.mark.slow
def test_transformers_reads_the_byte_tokenizer_of_an_export(python, from_scratch):
    _, export = from_scratch
    text = "héllo ☃\n\tx"
    code = (
        "import sys, transformers; t = transformers.AutoTokenizer.from_pretrained(sys.argv[1]); "
        "ids = t(sys.argv[2]).input_ids; print(ids, t.eos_token_id, repr(t.decode(ids)))"
    )
    done = subprocess.run(
        [python, "-c", code, str(export), text], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"{list(text.encode())} 256 {text!r}"
