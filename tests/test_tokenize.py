"""`jaxdist tokenize`: the shards decode back to the input documents, the bytes do not depend on
the worker count, the eval split never moves, EOS only opens documents, and each bad input ends
in one ConfigError that names it."""

import gzip
import io
import json
import os
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest
import tyro
from rich.console import Console

from jaxdist.cli import cmd_data
from jaxdist.data import encode as tz
from jaxdist.data import manifest as mf
from jaxdist.data import tokenizer as tk
from jaxdist.errors import ConfigError

WORDS = (
    "the of and to in data model tensor shard mesh café naïve Größe 中文 数据 🙂 ∑ \t\n "
    "<|endoftext|> </s>"
).split(" ")


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        f"doc {seed}.{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
        for i in range(n)
    ]


def write_corpus(root: pathlib.Path, docs: list[str]) -> None:
    """Text files, JSONL (with a blank line), .jsonl.gz and .txt.gz whose sorted order under
    `root` is the order of `docs`."""
    (root / "a").mkdir(parents=True)
    (root / "a" / "0.txt").write_text(docs[0], encoding="utf-8")
    (root / "a" / "1.txt").write_text(docs[1], encoding="utf-8")
    lines = [json.dumps({"text": t}) for t in docs[2:-6]]
    lines.insert(3, "   ")
    (root / "b.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in docs[-6:-1])
    (root / "d.txt.gz").write_bytes(gzip.compress(docs[-1].encode("utf-8")))


def run(inputs, out, tokenizer="bytes", **options) -> mf.Manifest:
    config = tz.TokenizeConfig(tuple(map(str, inputs)), str(out), tokenizer, **options)
    return tz.tokenize(config, Console(file=io.StringIO()))


def stored(out: pathlib.Path, split: str) -> list[np.ndarray]:
    """Each document's tokens, its EOS checked and dropped."""
    manifest = mf.read(out)
    docs = []
    for shard in manifest.splits[split].shards:
        tokens = np.fromfile(out / shard.tokens_file, np.dtype(manifest.dtype).newbyteorder("<"))
        firsts = np.fromfile(out / shard.docs_file, "<i8")
        assert firsts[0] == 0 and (tokens[firsts] == manifest.eos_id).all()
        assert np.count_nonzero(tokens == manifest.eos_id) == len(firsts)  # EOS only opens
        for a, b in zip(firsts, [*firsts[1:], len(tokens)], strict=True):
            docs.append(tokens[a + 1 : b])
    return docs


def split_of(docs: list[str], fraction: float) -> tuple[list[str], list[str]]:
    held = [tz.in_eval(t.encode("utf-8"), fraction) for t in docs]
    return [t for t, h in zip(docs, held, strict=True) if not h], [
        t for t, h in zip(docs, held, strict=True) if h
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    """A small BPE's tokenizer.json, trained once for the tests that pass a path."""
    directory = tmp_path_factory.mktemp("tokenizer")
    tk.train(texts(40, seed=9), 300).save(directory)
    return directory / "tokenizer.json"


def test_bpe_shards_decode_to_the_input_in_order(tmp_path):
    docs = texts(31)
    write_corpus(tmp_path / "in", docs)
    out = tmp_path / "out"
    manifest = run([tmp_path / "in"], out, "train:300", eval_fraction=0.3)
    mf.verify(out, manifest)
    assert manifest.tokenizer == "tokenizer.json" and manifest.eos_id == 0
    assert manifest.tokenizer_sha256 == mf.sha256_file(out / "tokenizer.json")
    assert manifest.dtype == "uint16" and 257 < manifest.vocab_size <= 300

    tokenizer = tk.from_data_dir(out)
    train, held = split_of(docs, 0.3)
    assert train and held  # both splits exercised
    for name, want in (("train", train), ("eval", held)):
        got = stored(out, name)
        assert [tokenizer.decode(ids) for ids in got] == want
        assert all(
            np.array_equal(ids, tokenizer.encode(t)) for ids, t in zip(got, want, strict=True)
        )
        split = manifest.splits[name]
        assert split.text_bytes == sum(len(t.encode("utf-8")) for t in want)
        assert split.num_documents == len(want)


def test_the_same_bytes_for_any_worker_count(tmp_path, monkeypatch):
    docs = texts(60, seed=1)
    write_corpus(tmp_path / "in", docs)
    monkeypatch.setattr(tz, "CHUNK_BYTES", 300)  # many chunks, two processes
    one, two = tmp_path / "one", tmp_path / "two"
    run([tmp_path / "in"], one, "train:300", eval_fraction=0.2, workers=1)
    run([tmp_path / "in"], two, "train:300", eval_fraction=0.2, workers=2)
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir()) and "tokenizer.json" in names
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    # A worker's ConfigError reaches the caller, and nothing is left behind.
    (tmp_path / "in" / "b.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"b\.jsonl:2 is not a JSON object"):
        run([tmp_path / "in"], tmp_path / "bad", workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "one", "two"]


def test_bpe_training_is_deterministic_across_processes(tmp_path):
    docs = texts(50, seed=2)
    here = tk.train(docs, 400).json_text
    assert tk.train(docs, 400).json_text == here
    code = (
        "import json, sys; from jaxdist.data import tokenizer as tk; "
        "sys.stdout.write(tk.train(json.load(sys.stdin), 400).json_text)"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "RAYON_NUM_THREADS": "1"},  # another thread count, too
        cwd=pathlib.Path(__file__).parent.parent,
    ).stdout
    assert other == here


def test_eval_split_stays_when_documents_are_added(tmp_path):
    docs = texts(40, seed=3)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs))
    run([tmp_path / "in"], tmp_path / "before", eval_fraction=0.25)
    added = texts(15, seed=4)
    (tmp_path / "in" / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in added))
    run([tmp_path / "in"], tmp_path / "after", eval_fraction=0.25)
    decode = tk.Tokenizer().decode
    before = [decode(d) for d in stored(tmp_path / "before", "eval")]
    after = [decode(d) for d in stored(tmp_path / "after", "eval")]
    assert before and [t for t in after if t in docs] == before
    assert [t for t in after if t not in docs] == split_of(added, 0.25)[1]


def test_byte_tokenizer_round_trip(tmp_path):
    docs = ["héllo wörld", "中文 数据 🙂", "plain ascii", "<|endoftext|> is text here"]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs))
    out = tmp_path / "out"
    manifest = run([tmp_path / "d.jsonl"], out, eval_fraction=0)
    assert (manifest.tokenizer, manifest.tokenizer_sha256) == ("bytes", None)
    assert (manifest.vocab_size, manifest.eos_id, manifest.dtype) == (257, 256, "uint16")
    assert not (out / "tokenizer.json").exists()
    assert manifest.splits["eval"].shards == () and not list(out.glob("eval-*"))
    got = stored(out, "train")
    assert [bytes(d.astype(np.uint8)) for d in got] == [t.encode("utf-8") for t in docs]
    tokenizer = tk.from_data_dir(out)
    assert [tokenizer.decode(d) for d in got] == docs
    assert tokenizer.decode([104, 105, 256, 33]) == "hi!"  # EOS dropped


def test_a_given_tokenizer_json_is_used_and_copied(tmp_path, trained):
    docs = texts(12, seed=5)
    (tmp_path / "a.txt").write_text(docs[0])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs[1:]))
    out = tmp_path / "out"
    manifest = run([tmp_path / "a.txt", tmp_path / "b.jsonl"], out, str(trained), eval_fraction=0)
    assert (out / "tokenizer.json").read_bytes() == trained.read_bytes()
    assert manifest.tokenizer_sha256 == mf.sha256_file(trained)
    given = tk.load(trained)
    assert [list(d) for d in stored(out, "train")] == [list(given.encode(t)) for t in docs]


def hand_made(path: pathlib.Path, specials: list[str], vocab: dict[str, int] | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = vocab or {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(path))
    return path


def test_eos_is_the_first_known_end_token(tmp_path):
    # Three words (ids 0-2), then the special tokens in the order given.
    assert tk.load(hand_made(tmp_path / "a.json", ["<pad>", "</s>"])).eos_id == 4
    assert tk.load(hand_made(tmp_path / "b.json", ["</s>", "<|endoftext|>"])).eos_id == 4
    with pytest.raises(ConfigError, match=r"c\.json declares no EOS beside it.*has none of the"):
        tk.load(hand_made(tmp_path / "c.json", ["<pad>"]))


def test_eos_declared_beside_the_tokenizer_comes_first(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    path = hand_made(model / "tokenizer.json", ["<|endoftext|>", "<|im_end|>"])  # ids 3, 4
    assert tk.load(path).eos_id == 3  # by name, nothing declared
    (model / "config.json").write_text(json.dumps({"eos_token_id": [4, 3]}))
    assert tk.load(path).eos_id == 4  # config.json's, the first of its list
    declared = {"eos_token": {"content": "<|endoftext|>", "special": True}}
    (model / "tokenizer_config.json").write_text(json.dumps(declared))
    assert tk.load(path).eos_id == 3  # the tokenizer's own declaration before the model's
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "d.txt").write_text("hello world")
    manifest = run([tmp_path / "d.txt"], tmp_path / "out", str(model), eval_fraction=0)
    assert manifest.eos_id == 4 and list(stored(tmp_path / "out", "train")[0]) == [1, 2]
    # The data directory's copy has nothing beside it: its EOS is the manifest's.
    assert tk.from_data_dir(tmp_path / "out").eos_id == 4


def test_eos_never_inside_a_document(tmp_path):
    # Special tokens in the text are encoded as text...
    (tmp_path / "d.txt").write_text("hello <|endoftext|> world </s>")
    out = tmp_path / "out"
    run([tmp_path / "d.txt"], out, str(hand_made(tmp_path / "t.json", ["<|endoftext|>"])))
    assert list(stored(out, "train")[0]) == [1, 0, 2, 0]  # [UNK] for the unknown words
    # ...and a vocabulary that maps text onto the EOS id is refused, naming the document.
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2}
    path = hand_made(tmp_path / "u.json", ["</s>"], vocab)
    with pytest.raises(ConfigError, match=r"d\.txt: the tokenizer encodes this text to its EOS"):
        run([tmp_path / "d.txt"], tmp_path / "out2", str(path))


def test_shards_break_between_documents(tmp_path):
    docs = [f"{i} " + "x" * (10 * (i % 5)) for i in range(30)] + ["y" * 250]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in docs))
    out = tmp_path / "out"
    manifest = run([tmp_path / "d.jsonl"], out, eval_fraction=0, shard_tokens=100)
    mf.verify(out, manifest)
    shards = manifest.splits["train"].shards
    assert len(shards) > 5
    assert all(s.num_tokens <= 100 or s.num_documents == 1 for s in shards)
    assert shards[-1].num_tokens == 251  # longer than a shard: one of its own
    decode = tk.Tokenizer().decode
    assert [decode(d) for d in stored(out, "train")] == docs


def test_cli_repeated_input_and_an_empty_out(tmp_path, capsys):
    from jaxdist.cli.main import main

    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "out").mkdir()
    argv = ["--input", str(tmp_path / "a.txt"), "--input", str(tmp_path / "b.txt")]
    argv += ["--out", str(tmp_path / "out"), "--tokenizer", "bytes", "--eval-fraction", "0"]
    args = tyro.cli(cmd_data.Tokenize, args=argv)
    assert args.input == (str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))
    assert main(["tokenize", *argv]) == 0
    assert "out: 2 documents, 0.0 MB of text" in capsys.readouterr().out
    decoded = [bytes(d.astype(np.uint8)) for d in stored(tmp_path / "out", "train")]
    assert decoded == [b"first", b"second"]
    assert main(["tokenize", *argv]) == 2  # the directory is taken now: one line, exit 2
    assert "jaxdist: error: --out" in capsys.readouterr().err


BAD = {
    "missing": ("nope.txt", {}, "--input .*nope.txt does not exist"),
    "no match": ("*.nothing", {}, r"matched no files"),
    "empty dir": ("emptydir", {}, r"matched no files"),
    "all empty": ("empty", {}, r"hold no text"),
    "corrupt gz": ("bad.txt.gz", {}, r"cannot read .*bad\.txt\.gz"),
    "truncated gz": ("cut.jsonl.gz", {}, r"cannot read .*cut\.jsonl\.gz"),
    "not json": ("lines.jsonl", {}, r"lines\.jsonl:2 is not a JSON object"),
    "no text field": ("notext.jsonl", {}, r"notext\.jsonl:1 is not a JSON object"),
    "text not a string": ("number.jsonl", {}, r"number\.jsonl:1 is not a JSON object"),
    "not utf-8": ("latin1.txt", {}, r"latin1\.txt is not UTF-8 text"),
    "tokenizer form": ("ok.txt", {"tokenizer": "gpt2"}, r"--tokenizer gpt2 is not a file"),
    "vocab too small": ("ok.txt", {"tokenizer": "train:200"}, r"more than 257 tokens"),
    "vocab not int": ("ok.txt", {"tokenizer": "train:big"}, r"not an integer"),
    "eval fraction 1": ("ok.txt", {"eval_fraction": 1.0}, r"outside \[0, 1\)"),
    "eval fraction < 0": ("ok.txt", {"eval_fraction": -0.1}, r"outside \[0, 1\)"),
    "out not empty": ("ok.txt", {"out": "full"}, r"already exists and is not an empty"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_config_error(tmp_path, case):
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.jsonl").write_text('{"text": ""}\n\n')
    (tmp_path / "bad.txt.gz").write_bytes(b"this is not gzip")
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "abc"}\n' * 50)[:-12])
    (tmp_path / "lines.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "number.jsonl").write_text('{"text": 5}\n')
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("taken")
    before = sorted(p.name for p in tmp_path.iterdir())
    name, options, message = BAD[case]
    out = tmp_path / options.pop("out", "out")
    with pytest.raises(ConfigError, match=message):
        run([tmp_path / name], out, **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing half made
