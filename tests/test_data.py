"""The data stream is a pure function of (seed, step), split by process without overlap."""

import json

import numpy as np
import pytest

from jaxdist.data import DataConfig, TokenBatches
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
