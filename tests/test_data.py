"""The data stream is a pure function of (seed, step), split by process without overlap."""

import json

import numpy as np
import pytest

from jaxdist.config import DataConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError


def test_batch_is_a_function_of_seed_and_step():
    a = TokenBatches(DataConfig(batch_size=8, seed=1), 64, 256)
    b = TokenBatches(DataConfig(batch_size=8, seed=1), 64, 256)
    c = TokenBatches(DataConfig(batch_size=8, seed=2), 64, 256)
    assert a.batch(5).shape == (8, 65) and a.batch(5).dtype == np.int32
    np.testing.assert_array_equal(a.batch(5), b.batch(5))  # fresh reader, same stream
    assert not np.array_equal(a.batch(5), a.batch(6))
    assert not np.array_equal(a.batch(5), c.batch(5))


def test_processes_read_disjoint_slices_of_the_same_global_batch():
    whole = TokenBatches(DataConfig(batch_size=8), 64, 256).batch(3)
    parts = [
        TokenBatches(DataConfig(batch_size=8), 64, 256, range(2 * i, 2 * i + 2)).batch(3)
        for i in range(4)
    ]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_every_window_once_per_epoch_and_epochs_reshuffle(tmp_path):
    text = np.random.default_rng(0).integers(0, 256, 1024).astype(np.uint8)
    path = tmp_path / "t.bin"
    path.write_bytes(text.tobytes())
    d = TokenBatches(DataConfig(path=str(path), batch_size=5), 64, 256)
    assert d.num_windows == 15  # windows of 65 bytes share one: targets continue inputs
    windows = {text[i * 64 : i * 64 + 65].tobytes(): i for i in range(15)}
    epoch1 = np.concatenate([d.batch(s) for s in range(3)])
    seen = [windows[row.astype(np.uint8).tobytes()] for row in epoch1]
    assert sorted(seen) == list(range(15))
    epoch2 = np.concatenate([d.batch(s) for s in range(3, 6)])
    seen2 = [windows[row.astype(np.uint8).tobytes()] for row in epoch2]
    assert sorted(seen2) == list(range(15)) and seen2 != seen


def test_jsonl(tmp_path):
    docs = [f"document {i}: " + "hello world " * 20 for i in range(5)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in docs))
    d = TokenBatches(DataConfig(path=str(path), batch_size=2), 32, 256)
    # The texts, not the JSON around them, one after another: every row is a window of 33.
    corpus = "\n".join(docs).encode()
    assert d.num_windows == (len(corpus) - 1) // 32
    for row in d.batch(0):
        assert row.shape == (33,) and bytes(row.astype(np.uint8)) in corpus


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ('{"txt": 1}\n', "is not a JSON object with a string 'text'"),
        ("", "is empty"),
        ("short", "fewer than one sequence"),
    ],
)
def test_bad_data_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / ("d.jsonl" if content and content.startswith("{") else "d.txt")
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        TokenBatches(DataConfig(path=str(path), batch_size=2), 32, 256)


def test_default_corpus_is_the_standard_library():
    d = TokenBatches(DataConfig(batch_size=4), 128, 256)
    assert d.num_windows > 10_000


def test_a_directory_of_text_is_read_as_bytes_leaving_hidden_files_out(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta " * 20)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_bytes(b"\x00" * 500)
    d = TokenBatches(DataConfig(path=str(tmp_path), batch_size=2), 16, 256)
    # "alpha " x 20 and "beta " x 20 joined by one newline: 120 + 1 + 100 bytes, 15 per window.
    assert d.num_windows == (221 - 1) // 16
    assert all(0 not in row for row in d.batch(0))  # nothing of .git/index


@pytest.mark.parametrize(
    "make, message",
    [
        # A folder that is not there is not called a file, and the message says what --data
        # takes, tokenized directories first.
        (None, r"my_txts/ does not exist \(no directory there.*tokenized directory \(made by: "),
        ("empty", r"is a directory with no files in it; --data takes a tokenized directory"),
        ("gz", r"a\.txt\.gz and 1 more is compressed .* jaxdist tokenize --input "),
        ("shards", r"holds token shards but no manifest\.json .* jaxdist tokenize"),
    ],
)
def test_a_data_directory_that_cannot_be_read_says_what_data_takes(tmp_path, make, message):
    path = tmp_path / "my_txts"
    if make:
        path.mkdir()
    if make == "gz":
        (path / "a.txt.gz").write_bytes(b"\x1f\x8b" + b"x" * 100)
        (path / "b.txt.gz").write_bytes(b"\x1f\x8b" + b"x" * 100)
        (path / "c.txt").write_text("text " * 50)
    if make == "shards":
        (path / "train-00000.tokens").write_bytes(b"\x00" * 64)
        (path / "train-00000.docs").write_bytes(b"\x00" * 8)
    with pytest.raises(ConfigError, match=message):
        TokenBatches(DataConfig(path=f"{path}/", batch_size=2), 32, 256)
