"""Text to token ids and back, for a tokenized data directory (jaxdist.data.manifest).

Three kinds, named by `--tokenizer`:
  bytes               built in: ids 0..255 are the UTF-8 bytes, EOS is 256 (vocabulary 257);
                      no tokenizer.json is written
  train:VOCAB_SIZE    a byte-level BPE trained on the input documents (all of them, eval split
                      included: the tokenizer is fitted to the corpus, never the model), with
                      the Hugging Face `tokenizers` library; saved as DATA_DIR/tokenizer.json
  PATH                a tokenizer.json (the format models ship with), copied byte for byte

EOS opens every stored document, so it must never come out of a document's own text: special
tokens are encoded as ordinary text (`encode_special_tokens`), and the writer checks it. A
model's tokenizer.json gets its EOS from the files beside it (`declared_eos`: the tokenizer's
own tokenizer_config.json, else the model's config.json, else generation_config.json), and only
without them from the names end-of-text tokens usually have (EOS_CANDIDATES).
"""

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

from jaxdist.data import manifest as mf
from jaxdist.errors import ConfigError

BYTES = "bytes"
FILE = "tokenizer.json"
BYTE_EOS = 256
BYTE_VOCAB = 257
# The EOS of a tokenizer no file declares one for: the first of these it has (GPT-2 and most
# BPEs, Llama 2 and T5, Llama 3 base, Gemma, Llama 3 instruct).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
TRAIN_EOS = "<|endoftext|>"
SPEC_HELP = "pass bytes, train:VOCAB_SIZE (e.g. train:32768) or the path of a tokenizer.json"


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text. `json_text` None is the byte tokenizer; else
    the tokenizer.json text (`source` names where it came from, for errors), with `eos_id` as
    declared for it (None: the first special token named as EOS_CANDIDATES)."""

    def __init__(self, json_text: str | None = None, source: str = FILE, eos_id: int | None = None):
        self.json_text = json_text
        self._hf = None
        if json_text is None:
            self.vocab_size, self.eos_id = BYTE_VOCAB, BYTE_EOS
        else:
            from tokenizers import Tokenizer as HFTokenizer

            try:
                hf = HFTokenizer.from_str(json_text)
            except Exception as e:  # the Rust side raises plain Exception
                raise ConfigError(
                    f"{source} is not a tokenizer.json the `tokenizers` library can load ({e}); "
                    f"{SPEC_HELP}"
                ) from None
            # "<|endoftext|>" written in a document is text, not the separator.
            hf.encode_special_tokens = True
            self._hf = hf
            self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
            self.eos_id = _eos_id(hf, source) if eos_id is None else eos_id
            top = max(hf.get_vocab(with_added_tokens=True).values())
            if top >= self.vocab_size:
                raise ConfigError(
                    f"{source}: token id {top} is not below the vocabulary size "
                    f"{self.vocab_size} (ids with gaps); renumber the vocabulary densely"
                )
            if not 0 <= self.eos_id < self.vocab_size:
                raise ConfigError(
                    f"{source}: EOS id {self.eos_id} is not in its vocabulary of "
                    f"{self.vocab_size}; fix eos_token_id beside it"
                )
        self.dtype = np.dtype(mf.token_dtype(self.vocab_size))

    @property
    def name(self) -> str:
        """What the manifest records: "bytes" or "tokenizer.json"."""
        return BYTES if self.json_text is None else FILE

    @property
    def sha256(self) -> str | None:
        if self.json_text is None:
            return None
        return hashlib.sha256(self.json_text.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> np.ndarray:
        """The ids of `text` (no EOS, no BOS), in the shards' dtype."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self._hf is None:
            return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(self.dtype) for t in texts]
        encodings = self._hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.array(e.ids, dtype=self.dtype) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of `ids`; EOS and other special tokens are dropped. A cut multi-byte
        character (a generation stopped mid-way) decodes to U+FFFD."""
        ids = np.asarray(ids).tolist()
        if self._hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=True)

    def save(self, directory: str | pathlib.Path) -> None:
        """Writes DATA_DIR/tokenizer.json (nothing for the byte tokenizer)."""
        if self.json_text is not None:
            (pathlib.Path(directory) / FILE).write_bytes(self.json_text.encode("utf-8"))


def _eos_id(hf, source: str) -> int:
    added = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
    for name in EOS_CANDIDATES:
        if name in added:
            return added[name]
    raise ConfigError(
        f"{source} declares no EOS beside it (tokenizer_config.json eos_token, config.json "
        f"eos_token_id) and has none of the end-of-text tokens {', '.join(EOS_CANDIDATES)} among "
        "its special tokens, and every stored document starts with one; declare it in "
        "tokenizer_config.json or use --tokenizer train:VOCAB_SIZE"
    )


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({e}); fix or remove it") from None


def declared_eos(directory: pathlib.Path, json_text: str) -> int | None:
    """The EOS id a model directory declares for its tokenizer.json: tokenizer_config.json's
    eos_token (a name, looked up in the tokenizer), else config.json's eos_token_id, else
    generation_config.json's (the first of a list); None where none does."""
    name = _read_json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(name, dict):  # an AddedToken written out
        name = name.get("content")
    if isinstance(name, str):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            found = HFTokenizer.from_str(json_text).token_to_id(name)
        except Exception:  # not a tokenizer.json: Tokenizer() says so, in one line
            found = None
        if found is not None:
            return found
    for f in ("config.json", "generation_config.json"):
        eos = _read_json(directory / f).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int):
            return eos
    return None


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """A parsed --tokenizer: `train_vocab` for train:V, `path` for a tokenizer.json, neither
    for bytes."""

    train_vocab: int | None = None
    path: pathlib.Path | None = None


def parse_spec(spec: str) -> TokenizerSpec:
    """Checked before any input is read, so a typo fails at once."""
    if spec == BYTES:
        return TokenizerSpec()
    if spec.startswith("train:"):
        try:
            vocab = int(spec.removeprefix("train:"))
        except ValueError:
            raise ConfigError(
                f"--tokenizer {spec}: the vocabulary size is not an integer; pass e.g. train:32768"
            ) from None
        if not BYTE_VOCAB < vocab <= 2**32:
            raise ConfigError(
                f"--tokenizer {spec}: a byte-level BPE starts from 256 byte tokens and "
                f"{TRAIN_EOS}, so it needs more than {BYTE_VOCAB} tokens (and at most 2**32); "
                "pass e.g. train:32768, or --tokenizer bytes"
            )
        return TokenizerSpec(train_vocab=vocab)
    path = pathlib.Path(spec)
    if path.is_dir() and (path / FILE).is_file():
        path = path / FILE  # a model's directory: its tokenizer.json
    if not path.is_file():
        raise ConfigError(f"--tokenizer {spec} is not a file nor a known form; {SPEC_HELP}")
    return TokenizerSpec(path=path)


def load(path: str | pathlib.Path, eos_id: int | None = None) -> Tokenizer:
    """A tokenizer.json, its EOS `eos_id` if given, else as the files beside it declare
    (declared_eos), else found by name. Its exact bytes are kept: the copy in DATA_DIR has the
    same sha256."""
    path = pathlib.Path(path)
    try:
        # Bytes, not read_text: newline translation would change the checksum.
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read tokenizer {path} ({e}); {SPEC_HELP}") from None
    if eos_id is None:
        eos_id = declared_eos(path.parent, text)
    return Tokenizer(text, source=str(path), eos_id=eos_id)


def train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens (fewer if the texts run out of pairs to merge),
    with TRAIN_EOS as its only special token (id 0).

    Deterministic: the same texts in the same order give the same tokenizer.json bytes whatever
    the thread count (merge ties break on token ids, and the file lists the vocabulary by id);
    tests/test_tokenize.py checks it across processes."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAIN_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf.to_str(pretty=True), source=f"train:{vocab_size}")


def from_data_dir(directory: str | pathlib.Path) -> Tokenizer:
    """The tokenizer a data directory was written with, checked against its manifest."""
    directory = pathlib.Path(directory)
    manifest = mf.read(directory)
    if manifest.tokenizer == BYTES:
        tokenizer = Tokenizer()
    else:
        path = directory / manifest.tokenizer
        if not path.is_file():
            raise ConfigError(
                f"{path} is missing (the manifest names it); restore it or tokenize again"
            )
        # The manifest's EOS: the one declared beside the model's tokenizer when it was written.
        tokenizer = load(path, eos_id=manifest.eos_id)
        if tokenizer.sha256 != manifest.tokenizer_sha256:
            raise ConfigError(
                f"{path} is not the tokenizer the shards were written with (checksum differs); "
                "restore it or tokenize the data again"
            )
    if (tokenizer.vocab_size, tokenizer.eos_id) != (manifest.vocab_size, manifest.eos_id):
        raise ConfigError(
            f"{directory}: the tokenizer has vocabulary {tokenizer.vocab_size} and EOS "
            f"{tokenizer.eos_id}, the manifest {manifest.vocab_size} and {manifest.eos_id}; "
            "tokenize the data again"
        )
    return tokenizer
