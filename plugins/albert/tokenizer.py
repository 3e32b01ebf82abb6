"""ALBERT's tokenizer: a Unigram (SentencePiece-style) model trained on the corpus, or loaded from a file.

Trained with the `tokenizers` library: NFKC and lower-casing (as ALBERT's released models), the
Metaspace pre-tokenizer (words start with "▁"), special tokens [PAD] [UNK] [CLS] [SEP] [MASK] at
ids 0 to 4. Unigram training is not bit-for-bit reproducible (its floating-point sums follow a
hash map's order, which changes from process to process), so the trained vocabulary is made
canonical: special tokens first, then the pieces sorted by text, scores rounded to 1e-6. Peers
that train on the same corpus thus get the same ids. A run across machines should still hand
every peer the same file through `tokenizer_path`.

A trained tokenizer is cached in the cache folder under a key made of the corpus's fingerprint,
the vocabulary size and the recipe, so each peer trains it once.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .corpus import Corpus, split_sentences, write_atomically

TOKENIZER_VERSION = 1
"""Bumped when the training recipe changes (it keys the cache)."""

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TRAIN_SAMPLE_BYTES = 32 << 20
"""At most about this much of the train split trains the tokenizer (every k-th document)."""

# Names by which a tokenizer loaded from a file may call its special tokens (ALBERT's own
# SentencePiece vocabulary uses <pad> and <unk>).
_ALIASES = {"pad": ("[PAD]", "<pad>"), "unk": ("[UNK]", "<unk>"), "cls": ("[CLS]", "<s>"),
            "sep": ("[SEP]", "</s>"), "mask": ("[MASK]", "<mask>")}


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer and the ids the data pipeline needs."""

    tokenizer: Tokenizer
    pad: int
    unk: int
    cls: int
    sep: int
    mask: int
    size: int

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids that are never masked nor drawn as random replacements ([UNK] is a normal token)."""
        return (self.pad, self.cls, self.sep, self.mask)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


def vocabulary(tokenizer: Tokenizer) -> Vocabulary:
    """The special ids of `tokenizer` (ValueError naming a missing one)."""
    ids = {}
    for role, names in _ALIASES.items():
        found = [tokenizer.token_to_id(name) for name in names]
        found = [index for index in found if index is not None]
        if not found:
            raise ValueError(f"the tokenizer has no {role} token (looked for {', '.join(names)})")
        ids[role] = found[0]
    return Vocabulary(tokenizer=tokenizer, size=tokenizer.get_vocab_size(), **ids)


def new_tokenizer() -> Tokenizer:
    """An untrained Unigram tokenizer with ALBERT's normalisation and SentencePiece's spaces."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return tokenizer


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Train a Unigram tokenizer of at most `vocab_size` pieces (specials included), canonically."""
    tokenizer = new_tokenizer()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                      unk_token="[UNK]", show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return canonical(tokenizer)


def canonical(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` with its vocabulary in a reproducible order (see the module docstring)."""
    document = json.loads(tokenizer.to_str())
    model = document["model"]
    specials = [[token, 0.0] for token in SPECIAL_TOKENS]
    pieces = sorted([piece, round(float(score), 6)] for piece, score in model["vocab"]
                    if piece not in SPECIAL_TOKENS)
    model["vocab"] = specials + pieces
    model["unk_id"] = SPECIAL_TOKENS.index("[UNK]")
    cls, sep = SPECIAL_TOKENS.index("[CLS]"), SPECIAL_TOKENS.index("[SEP]")
    result = Tokenizer.from_str(json.dumps(document))
    result.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return result


def _training_texts(corpus: Corpus) -> Iterator[str]:
    stride = max(1, -(-corpus.train_bytes() // TRAIN_SAMPLE_BYTES))
    for index, document in enumerate(corpus.train):
        if index % stride == 0:
            yield from split_sentences(document.read())


def cache_key(corpus: Corpus, vocab_size: int) -> str:
    text = f"{TOKENIZER_VERSION}\n{tokenizers.__version__}\n{corpus.fingerprint}\n{vocab_size}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@functools.lru_cache(maxsize=8)
def _from_file(path: str, _mtime: int) -> Vocabulary:
    return vocabulary(Tokenizer.from_file(path))


def load_vocabulary(corpus: Corpus, vocab_size: int, tokenizer_path: str, cache_dir: Path) -> Vocabulary:
    """The tokenizer of `tokenizer_path`, else the one trained on `corpus` (cached in `cache_dir`).

    Raises ValueError when the tokenizer has more tokens than the model's `vocab_size`.
    """
    if tokenizer_path:
        path = Path(tokenizer_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer_path {tokenizer_path!r} is not a file")
    else:
        path = cache_dir / f"tokenizer-{cache_key(corpus, vocab_size)}.json"
        if not path.is_file():
            trained = train_tokenizer(_training_texts(corpus), vocab_size)
            write_atomically(path, trained.to_str().encode())
    vocab = _from_file(str(path), path.stat().st_mtime_ns)
    if vocab.size > vocab_size:
        raise ValueError(f"the tokenizer {path} has {vocab.size} tokens, more than the model's "
                         f"vocab_size {vocab_size}")
    return vocab
