"""Held-out data smaller than what one evaluation reads: one warning line, and the tokens the
loss is really over (the distinct ones) reported beside the tokens it averages."""

import json

import numpy as np
import pytest

from jaxdist.cli.main import main
from jaxdist.config import DataConfig
from jaxdist.data import TokenBatches
from jaxdist.data.tokenset import TokenSet
from jaxdist.evaluation import distinct_windows
from jaxdist.metrics.records import read_metrics
from tests.test_token_data import make_data, random_docs

SEQ = 32  # windows of 33 tokens, neighbours sharing one: (tokens - 1) // 32 of them


def _data(root, name, seed, alphabet="abcdefgh "):
    """200 random documents of 5-120 bytes, a tenth held out."""
    return make_data(root, name, random_docs(200, seed, alphabet), eval_fraction=0.1)


def _windows(data) -> int:
    return (TokenSet(data).split("eval").num_tokens - 1) // SEQ


def test_distinct_windows_match_the_rows_read(tmp_path):
    """The count from the stream's order, against the rows themselves: a mixture of two small
    eval splits, read for more rows than they hold (each source wraps at its own point)."""
    a = _data(tmp_path, "a", 1)
    b = _data(tmp_path, "b", 2, alphabet="ijklmnop ")
    config = DataConfig(path=f"a={a}:0.7,b={b}:0.3", batch_size=8, seed=5)
    batches = TokenBatches(config, SEQ, 384, split="eval")
    assert batches.num_windows < 80  # so that 10 batches of 8 wrap
    for n in (1, 3, 10):
        rows = np.concatenate([batches.batch(s) for s in range(n)])
        assert distinct_windows(batches, n) == len({r.tobytes() for r in rows})


@pytest.mark.slow
def test_a_tiny_eval_split_is_warned_of_and_its_distinct_tokens_reported(tmp_path, capsys):
    data = _data(tmp_path, "data", 3)
    W = _windows(data)
    assert 8 <= W < 160  # 160: one evaluation of 20 batches of 8
    run = tmp_path / "run"
    train = ["train", "--data", str(data), "--model", "tiny", "--seq-len", str(SEQ), "--steps"]
    # One step: what is checked is the evaluation at the end of the run, of whatever weights.
    train += ["1", "--batch-size", "8", "--run-dir", str(run), "--devices", "cpu:8"]
    assert main(train) == 0
    err = capsys.readouterr().err
    # 20 x 8 = 160 sequences read, W distinct (160 > W: the first pass reads every one).
    warning = (
        f"held-out data too small: the eval split of {data} holds {W:,} sequences of 32 "
        f"tokens, one evaluation reads 160 (20 batches of 8), so batches repeat and the loss "
        f"is over {W * 32:,} distinct tokens, not 5,120; tokenize with a larger "
        "--eval-fraction, pass more held-out data, or lower --eval-batches"
    )
    assert err.splitlines().count(f"jaxdist: warning: {warning}") == 1
    assert f"over 5,120 tokens (batches repeat: {W * 32:,} distinct)" in err
    (ev,) = [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    assert (ev["eval_tokens"], ev["eval_distinct_tokens"]) == (5120, W * 32)

    assert main(["eval", str(run), "--batches", "20", "--devices", "cpu:8", "--json"]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out.strip().splitlines()[-1])
    assert (got["tokens"], got["distinct_tokens"], got["distinct_windows"]) == (5120, W * 32, W)
    ours = warning.replace("--eval-batches", "--batches")
    assert out.err.splitlines().count(f"jaxdist: warning: {ours}") == 1
    np.testing.assert_allclose(got["loss"], ev["eval_loss"], rtol=1e-5)  # the same 20 batches

    # One batch of 8 reads 8 different sequences: no warning, every token distinct.
    assert main(["eval", str(run), "--batches", "1", "--devices", "cpu:8", "--json"]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out.strip().splitlines()[-1])
    assert got["tokens"] == got["distinct_tokens"] == 8 * 32
    assert "warning" not in out.err
