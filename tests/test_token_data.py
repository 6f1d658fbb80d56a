"""Tokenized data in training: memory-mapped shards read by row, mixtures, padded vocabularies,
evaluation on any mesh, and the checks that stop bad data before anything compiles."""

import json
import math
import shutil
import signal
import time

import jax
import numpy as np
import pytest
from helpers import cli, cli_popen, losses, mesh_for
from rich.console import Console

from jaxdist import train as loop
from jaxdist.cli.main import main
from jaxdist.config import DataConfig, EvalConfig, LoopConfig, OptimConfig, RunConfig
from jaxdist.data import TokenBatches
from jaxdist.data.encode import TokenizeConfig, tokenize
from jaxdist.data.tokenset import TokenSet
from jaxdist.errors import ConfigError
from jaxdist.evaluation import evaluate
from jaxdist.kernels.loss import cross_entropy
from jaxdist.layout import Layout, StepConfig
from jaxdist.optim import make_optimizer
from jaxdist.step import Vocab, build
from jaxdist.train import fit
from meshes.presets import STANDARD_RULES
from models.presets import get_model_config, model_spec, with_data_vocab

QUIET = Console(quiet=True)


def write_docs(path, docs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps({"text": t}) for t in docs))
    return path


def random_docs(n: int, seed: int, alphabet: str = "abcdefgh ") -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(alphabet), rng.integers(5, 120))) for _ in range(n)]


def make_data(root, name, docs, tokenizer="bytes", eval_fraction=0.2):
    src = write_docs(root / f"{name}-src" / "docs.jsonl", docs)
    out = root / name
    tokenize(
        TokenizeConfig(
            inputs=(str(src),),
            out=str(out),
            tokenizer=tokenizer,
            eval_fraction=eval_fraction,
            workers=1,
        ),
        QUIET,
    )
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("tok"), "main", random_docs(400, 0))


def test_batch_is_the_same_for_1_2_and_4_processes(data_dir):
    cfg = DataConfig(path=str(data_dir), batch_size=8, seed=3)
    for step in (0, 7, 123):
        whole = TokenBatches(cfg, 64, 384).batch(step)
        assert whole.shape == (8, 65) and whole.dtype == np.int32
        for procs in (2, 4):
            n = 8 // procs
            parts = [
                TokenBatches(cfg, 64, 384, range(i * n, (i + 1) * n)).batch(step)
                for i in range(procs)
            ]
            np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_rows_are_windows_of_the_documents_with_eos_between(data_dir):
    batches = TokenBatches(DataConfig(path=str(data_dir), batch_size=4), 32, 384)
    assert batches.vocab_size == 257 and batches.eos_id == 256
    tokens = TokenSet(data_dir)
    text = tokens.stream("train").read(0, tokens.split("train").num_tokens)
    for row in batches.batch(5):
        hits = np.flatnonzero(text[: len(text) - 32] == row[0])
        assert any(np.array_equal(text[h : h + 33], row) for h in hits)


def test_mixture_proportions_fall_in_a_binomial_interval(tmp_path):
    a = make_data(tmp_path, "a", random_docs(200, 1, "ab"))
    b = make_data(tmp_path, "b", random_docs(200, 2, "xy"))
    spec = f"web={a}:0.7,code={b}:0.3"
    batches = TokenBatches(DataConfig(path=spec, batch_size=16, seed=5), 32, 384)
    rows = np.concatenate([batches.batch(s) for s in range(200)])
    # Classify each row by its text: source a writes only a/b, source b only x/y.
    from_a = np.isin(rows, [ord("a"), ord("b")]).any(1)
    from_b = np.isin(rows, [ord("x"), ord("y")]).any(1)
    assert not (from_a & from_b).any()
    n, k = len(rows), int(from_a.sum())
    half_width = 2.576 * math.sqrt(n * 0.7 * 0.3)  # 99% normal approximation
    assert abs(k - 0.7 * n) <= half_width, (k, n)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("web={a}:0,code={a}:1", "must be > 0"),
        ("web={a}:0.5,code={missing}:0.5", "not a tokenized directory"),
        ("web={a}:0.5,code={bpe}:0.5", "another tokenizer"),
        ("web={a}", "is not NAME=DATA_DIR:WEIGHT"),
    ],
)
def test_bad_mixtures_are_refused(tmp_path_factory, data_dir, spec, message):
    root = tmp_path_factory.getbasetemp()
    bpe = root / "bpe-mix"
    if not bpe.exists():
        make_data(root, "bpe-mix", random_docs(60, 4), tokenizer="train:300")
    path = spec.format(a=data_dir, missing=root / "nope", bpe=bpe)
    with pytest.raises(ConfigError, match=message):
        TokenBatches(DataConfig(path=path, batch_size=4), 32, 512)


@pytest.mark.parametrize("damage", ["truncate", "alter", "remove"])
def test_damaged_shards_are_named_before_anything_runs(tmp_path, data_dir, damage):
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    shard = copy / "train-00000.tokens"
    raw = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(raw[:-10])
    elif damage == "alter":
        raw[100] ^= 1
        shard.write_bytes(raw)
    else:
        shard.unlink()
    message = {"truncate": "truncated", "alter": "checksum", "remove": "missing"}[damage]
    with pytest.raises(ConfigError, match=f"train-00000.tokens.*{message}"):
        TokenBatches(DataConfig(path=str(copy), batch_size=4), 32, 384)


def test_model_vocabulary_too_small_is_refused(data_dir):
    with pytest.raises(ConfigError, match="vocabulary of at least 257"):
        TokenBatches(DataConfig(path=str(data_dir), batch_size=4), 32, 256)


def test_padded_ids_get_no_probability():
    rng = np.random.default_rng(0)
    logits = jax.numpy.asarray(rng.normal(size=(2, 5, 384)), jax.numpy.float32)
    targets = jax.numpy.asarray(rng.integers(0, 257, (2, 5)))
    # Jitted: one compile each, not one per eager op (the numbers are the same program's).
    masked = jax.jit(lambda x: cross_entropy(x, targets, vocab_size=257))(logits)
    whole = jax.jit(lambda x: cross_entropy(x[..., :257], targets))(logits)
    np.testing.assert_allclose(masked, whole, rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: cross_entropy(x, targets, vocab_size=257)))(logits)
    assert np.all(np.asarray(grad[..., 257:]) == 0) and np.isfinite(grad).all()


# tiny's own length, as `jaxdist train` runs it: every step built here, by _run and by
# cli_run has the same weights' shapes, so one compiled init (on the 3-axis mesh) and one set
# of checkpoint programs serve them all.
SEQ = 128
TRAIN_MESH = "data=2,fsdp=2,tensor=2"


def _compiled(layout, vocab, document_mask=True, microbatches=1, batch_size=16):
    cfg = with_data_vocab(get_model_config("tiny", seq_len=SEQ), vocab.size)
    model = model_spec(cfg)
    tx, lr = make_optimizer(OptimConfig(warmup_steps=2), 10)
    step = StepConfig(microbatches=microbatches, document_mask=document_mask)
    mesh = mesh_for(layout)
    layout = Layout.on(mesh, STANDARD_RULES, step, batch_size=batch_size, seq_len=SEQ)
    c = build(model.init, tx, lr, layout, mesh, vocab=vocab)
    return model, c


def _eval_loss(data_dir, layout: str, params) -> float:
    """The eval loss over 3 held-out batches on `layout`, of `params` placed on it."""
    model, c = _compiled(layout, Vocab(257, 256), microbatches=2 if "pipeline" in layout else 1)
    assert model.vocab_size == 384
    data = DataConfig(path=str(data_dir), batch_size=16)
    held = TokenBatches(data, model.seq_len, model.vocab_size, split="eval")
    return evaluate(c, jax.device_put(params, c.state_sharding.params), held, range(3))


@pytest.fixture(scope="module")
def one_device_eval(data_dir) -> tuple[float, object]:
    """The reference every layout is held to, and the weights it is of: the initial weights
    (as the runs below start from), evaluated on one device. Each layout evaluates these same
    weights placed on its mesh: what is compared is the evaluation alone (init on every
    layout is tests/test_equivalence.py's)."""
    _, c = _compiled(TRAIN_MESH, Vocab(257, 256))
    params = jax.device_get(c.init_fn().params)
    value = _eval_loss(data_dir, "single", params)
    assert np.isfinite(value)
    return value, params


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data=8", "fsdp=8", "pipeline=2,data=4"])
def test_eval_loss_on_any_mesh_equals_one_device(data_dir, one_device_eval, layout):
    want, params = one_device_eval
    np.testing.assert_allclose(_eval_loss(data_dir, layout, params), want, rtol=1e-5)


def _run(data_dir, run_dir, eval_cfg, steps=6, document_mask=True):
    model = model_spec(with_data_vocab(get_model_config("tiny", seq_len=SEQ), 257))
    config = RunConfig(
        OptimConfig(warmup_steps=2),
        DataConfig(path=data_dir and str(data_dir), batch_size=16),
        StepConfig(document_mask=document_mask),
        LoopConfig(steps=steps, log_every=1, run_dir=str(run_dir)),
        eval=eval_cfg,
    )
    fit(model, mesh_for(TRAIN_MESH), STANDARD_RULES, config, QUIET)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return losses(run_dir), [r for r in records if "eval_loss" in r]


@pytest.fixture(scope="module")
def eval_runs(data_dir, tmp_path_factory):
    """The same 4 steps with evaluation on and off (one compiled train step, which the mixture
    test below reuses), and 1 step without the document mask."""
    tmp = tmp_path_factory.mktemp("eval-runs")
    on, evals = _run(data_dir, tmp / "on", EvalConfig(eval_every=2, eval_batches=2), steps=4)
    off, none = _run(data_dir, tmp / "off", EvalConfig(eval_every=0), steps=4)
    # Step 0 already differs: the first batch's rows hold several documents, and the same
    # initial weights attend across them or not.
    unmasked, _ = _run(data_dir, tmp / "unmasked", EvalConfig(eval_every=0), 1, False)
    runs = {"on": on, "evals": evals, "off": off, "none": none, "unmasked": unmasked}
    return runs | {"off_dir": tmp / "off"}


@pytest.mark.slow
def test_training_losses_with_eval_on_are_bitwise_those_with_eval_off(eval_runs):
    on, off, evals = eval_runs["on"], eval_runs["off"], eval_runs["evals"]
    assert on == off and len(on) == 4
    assert not eval_runs["none"]
    assert [r["step"] for r in evals] == [1, 3]
    assert all(np.isfinite(r["eval_loss"]) and r["eval_tokens"] == 2 * 16 * SEQ for r in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it learns the held-out text too
    # The mask changes what the model computes (rows hold several documents).
    assert eval_runs["unmasked"][0] != on[0]


@pytest.mark.slow
def test_resume_on_other_data_is_refused_before_compiling(tmp_path, eval_runs, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(eval_runs["off_dir"], run)  # a finished 4-step run, resumed for 4 more

    # The step is built (jitted, not compiled) before the check; compiling starts at the
    # first call of one of its functions, which must not come.
    built = loop.build

    def never(*args, **kwargs):
        raise AssertionError("compiled before the resume was refused")

    def build(*args, **kwargs):
        return built(*args, **kwargs)._replace(step_fn=never, init_fn=never, eval_fn=never)

    monkeypatch.setattr("jaxdist.train.build", build)
    other = make_data(tmp_path, "other", random_docs(300, 9))
    with pytest.raises(ConfigError, match="another model, data stream.*fingerprint"):
        _run(other, run, EvalConfig(eval_every=0), steps=8)


def test_eval_with_raw_bytes_asks_for_held_out_data(tmp_path):
    with pytest.raises(ConfigError, match="no eval split"):
        _run(None, tmp_path / "r", EvalConfig(eval_every=2), steps=2)


# In this process: on the session's 8 CPU devices and its compile cache.
IN_PROCESS = ["--devices", "cpu:8", "--compile-cache", "off"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`jaxdist tokenize` (a BPE trained on the documents), then `jaxdist train` on its output
    with evaluation and checkpoints, once for both command-line tests below (the second runs
    the same command again, kills it and resumes it: this run is its reference)."""
    tmp = tmp_path_factory.mktemp("cli")
    src = write_docs(tmp / "text" / "a.jsonl", random_docs(300, 7))
    data = tmp / "data"
    tok = ["tokenize", "--input", str(src.parent), "--out", str(data), "--tokenizer", "train:320"]
    assert main([*tok, "--eval-fraction", "0.2", "--workers", "2"]) == 0
    train = ["train", "--data", str(data), "--steps", "10", "--eval-every", "5"]
    train += ["--eval-batches", "2", "--batch-size", "16", "--log-every", "1"]
    train += ["--checkpoint-every", "3"]
    run_dir = tmp / "reference"
    assert main([*train, "--run-dir", str(run_dir), *IN_PROCESS]) == 0
    return train, run_dir


@pytest.mark.slow
def test_tokenize_train_eval_from_the_command_line(cli_run):
    _, run_dir = cli_run
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["vocab_size"] == 384 and config["data_source"]["vocab_size"] == 320
    last_eval = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_eval = [x for x in last_eval if "eval_loss" in x][-1]
    # Another process: evaluation on 4 devices, which this one (on 8) cannot become.
    r = cli(
        "eval", str(run_dir), "--batches", "2", "--mesh", "fsdp=4", "--devices", "cpu:4", "--json"
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # The step named as the run names it: its checkpoint's and its last evaluation's.
    names = [p.name for p in (run_dir / "checkpoints").iterdir()]
    checkpoints = sorted(int(n) for n in names if n.isdigit())
    assert got["step"] == last_eval["step"] == checkpoints[-1]
    assert got["tokens"] == 2 * 16 * 128
    np.testing.assert_allclose(got["loss"], last_eval["eval_loss"], rtol=1e-5)
    np.testing.assert_allclose(got["perplexity"], math.exp(got["loss"]), rtol=1e-9)
    assert 0 < got["bits_per_byte"] < 8


@pytest.mark.slow
def test_kill9_and_resume_stays_bitwise_on_tokenized_data(tmp_path, cli_run, capsys):
    train, reference = cli_run
    run_dir = tmp_path / "killed"
    # kill -9 needs a process of its own. It stalls before step 8 (losses of steps 0..6
    # logged, checkpoints of steps 2 and 5 begun) so that it cannot finish before the kill,
    # however fast or slow this machine is; the kill lands at the stall or before it.
    stall = ["--fault-stall", "8:0:300"]
    p = cli_popen(*train, "--run-dir", str(run_dir), "--devices", "cpu:8", *stall)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(losses_or_empty(run_dir)) < 6:
        time.sleep(0.05)
    assert p.poll() is None, "finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert len(losses_or_empty(run_dir)) < 10
    capsys.readouterr()
    assert main([*train, "--run-dir", str(run_dir), *IN_PROCESS]) == 0
    assert "resuming from checkpoint step" in capsys.readouterr().err
    assert losses(run_dir) == losses(reference)  # bitwise, every step


def losses_or_empty(run_dir):
    return losses(run_dir) if (run_dir / "metrics.jsonl").exists() else {}


def test_a_model_that_takes_no_documents_is_told_how_to_fix_it():
    from flax import nnx

    class NoDocs(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.numpy.zeros((4,)))

        def __call__(self, tokens_BT):
            return tokens_BT, {}

    tx, lr = make_optimizer(OptimConfig(), 10)
    mesh = mesh_for("single")
    with pytest.raises(ConfigError, match="NoDocs is called without document masks"):
        build(
            NoDocs, tx, lr, Layout.on(mesh, STANDARD_RULES, batch_size=16), mesh, 0, Vocab(257, 256)
        )


@pytest.mark.slow
def test_training_on_a_mixture_logs_its_realised_proportions(tmp_path):
    a = make_data(tmp_path, "a", random_docs(200, 1, "ab"))
    b = make_data(tmp_path, "b", random_docs(200, 2, "xy"))
    spec = f"web={a}:0.7,code={b}:0.3"
    # 4 steps, as eval_runs: the same train step program (the session's cache has it).
    _, _ = _run(spec, tmp_path / "run", EvalConfig(eval_every=0), steps=4)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shares = [r["mixture"] for r in records if "loss" in r]
    assert len(shares) == 4 and set(shares[-1]) == {"web", "code"}
    counts = np.bincount(
        np.concatenate(
            [TokenBatches(DataConfig(spec, 16), SEQ, 384).draw.sources(s) for s in range(4)]
        ),
        minlength=2,
    )
    np.testing.assert_allclose(shares[-1]["web"], counts[0] / counts.sum())
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data_source"]["sources"] == ["web", "code"]
