"""ALBERT's data: corpus reading, the tokenizer, sentence-order pairs, packing and dynamic masking."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dedloc.plugins.albert import ALBERT
from dedloc.plugins.albert.corpus import Corpus, open_corpus, split_sentences
from dedloc.plugins.albert.pretraining import IGNORE_INDEX, Prefetched, document_pairs, mask_tokens, pack
from dedloc.plugins.albert.tokenizer import SPECIAL_TOKENS, Vocabulary, train_tokenizer, vocabulary

# --- corpus ---------------------------------------------------------------------------------------


def test_builtin_corpus_is_english_prose(builtin_corpus: Corpus, albert_cache: Path) -> None:
    assert len(builtin_corpus.train) > 300 and builtin_corpus.eval
    assert not set(builtin_corpus.train) & set(builtin_corpus.eval)
    assert builtin_corpus.train_bytes() > 500_000
    sentences = [s for doc in builtin_corpus.train[:50] for s in doc.sentences()]
    words = " ".join(sentences).lower().split()
    for common in ("the", "of", "is", "return", "a"):
        assert words.count(common) > 20, common
    # Deterministic: a second build (a fresh cache folder) gives the same text.
    again = open_corpus("", albert_cache / "again")
    assert again.fingerprint == builtin_corpus.fingerprint


# WikiText-103's raw layout: lines padded with spaces, blank lines holding one space.
WIKITEXT = "\n".join([
    " ", " = First Article = ", " ", " The first article starts here . It has two sentences . ", " ",
    " = = A section = = ", " ", " More text of the first article , in a section . ", " ",
    " = Second Article = ", " ", " The second article . ", ""])


def test_wikitext_layout(tmp_path: Path) -> None:
    (tmp_path / "wiki.train.raw").write_text(WIKITEXT)
    (tmp_path / "wiki.valid.raw").write_text(" = Valid = \n \n Held out text . Two . \n")
    corpus = open_corpus(str(tmp_path), tmp_path / "cache")
    assert [doc.sentences() for doc in corpus.train] == [
        ["The first article starts here .", "It has two sentences .",
         "More text of the first article , in a section ."],
        ["The second article ."]]
    assert [doc.sentences() for doc in corpus.eval] == [["Held out text .", "Two ."]]


def test_text_folder_holds_out_documents(tmp_path: Path) -> None:
    for index in range(25):
        (tmp_path / f"{index:02}.txt").write_text(f"Document {index} starts.\nIts paragraph goes on.\n\n"
                                                  "Another paragraph! Done.\n")
    corpus = open_corpus(str(tmp_path), tmp_path / "cache")
    assert len(corpus.train) == 24 and len(corpus.eval) == 1
    assert corpus.eval[0].sentences() == ["Document 19 starts.", "Its paragraph goes on.",
                                          "Another paragraph!", "Done."]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither"):
        open_corpus(str(tmp_path / "empty"), tmp_path / "cache")


def test_sentence_splitting() -> None:
    assert split_sentences("One two. Three four?\nStill four! (Five) six.\n\n= = H = =\nSeven") == [
        "One two.", "Three four?", "Still four!", "(Five) six.", "Seven"]


# --- tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_round_trips(tiny_vocab: Vocabulary, builtin_corpus: Corpus) -> None:
    assert [tiny_vocab.tokenizer.id_to_token(i) for i in range(5)] == list(SPECIAL_TOKENS)
    ids = (tiny_vocab.pad, tiny_vocab.unk, tiny_vocab.cls, tiny_vocab.sep, tiny_vocab.mask)
    assert ids == (0, 1, 2, 3, 4)
    assert tiny_vocab.size == 4000
    sentences = [s for doc in builtin_corpus.eval for s in doc.sentences()][:300]
    assert len(sentences) == 300
    exact = 0
    unknown = 0
    tokens = 0
    for sentence in sentences:
        ids = tiny_vocab.encode([sentence])[0]
        tokens += len(ids)
        unknown += ids.count(tiny_vocab.unk)
        exact += tiny_vocab.tokenizer.decode(ids) == " ".join(sentence.lower().split())
    assert exact >= 0.9 * len(sentences)
    assert unknown <= 0.01 * tokens
    assert tokens < 0.5 * sum(len(s) for s in sentences)  # pieces, not characters
    encoded = tiny_vocab.tokenizer.encode("The return value.", "It is None.")
    assert encoded.ids[0] == tiny_vocab.cls and encoded.ids.count(tiny_vocab.sep) == 2


def test_tokenizer_training_is_canonical() -> None:
    texts = [f"sentence number {i} about the {w} of things" for i in range(200)
             for w in ("shape", "colour", "weight", "age")]
    first = train_tokenizer(iter(texts), 120)
    second = train_tokenizer(iter(texts), 120)
    assert first.to_str() == second.to_str()
    assert vocabulary(first).size <= 120


# --- pairs and packing ----------------------------------------------------------------------------


def numbered_document(sentences: int, length: int) -> list[list[int]]:
    """Sentences of consecutive token ids (100, 101, ...), so that order can be checked."""
    return [list(range(100 + s * length, 100 + (s + 1) * length)) for s in range(sentences)]


@pytest.mark.parametrize("max_seq_length", [16, 64, 512])
def test_pairs_are_adjacent_fit_and_balanced(max_seq_length: int) -> None:
    rng = random.Random(3)
    pairs = []
    for _ in range(1000):
        document = numbered_document(rng.randint(1, 30), rng.randint(1, 40))
        pairs.extend(document_pairs(document, max_seq_length, rng))
    assert len(pairs) > 1000
    for pair in pairs:
        assert pair.first and pair.second
        assert len(pair.first) + len(pair.second) + 3 <= max_seq_length
        earlier, later = (pair.first, pair.second) if pair.label == 0 else (pair.second, pair.first)
        joined = earlier + later
        assert joined == list(range(joined[0], joined[0] + len(joined)))  # contiguous, in order
    swapped = sum(pair.label for pair in pairs) / len(pairs)
    assert abs(swapped - 0.5) < 0.05


def test_pairs_fill_the_target_length() -> None:
    rng = random.Random(1)
    pairs = list(document_pairs(numbered_document(400, 7), 128, rng))
    full = [p for p in pairs if len(p.first) + len(p.second) >= 125 - 7]
    assert len(full) >= 0.8 * len(pairs)  # about 10% are short on purpose


def test_packing(tiny_vocab: Vocabulary) -> None:
    rng = random.Random(0)
    pairs = list(document_pairs(numbered_document(40, 9), 32, rng))[:8]
    packed = pack(pairs, 32, tiny_vocab)
    assert packed.input_ids.shape == (8, 32)
    for row, pair in enumerate(pairs):
        ids = packed.input_ids[row].tolist()
        used = len(pair.first) + len(pair.second) + 3
        assert ids[:used] == [tiny_vocab.cls, *pair.first, tiny_vocab.sep, *pair.second, tiny_vocab.sep]
        assert ids[used:] == [tiny_vocab.pad] * (32 - used)
        assert packed.attention_mask[row].tolist() == [1] * used + [0] * (32 - used)
        types = [0] * (len(pair.first) + 2) + [1] * (len(pair.second) + 1) + [0] * (32 - used)
        assert packed.token_type_ids[row].tolist() == types
    assert packed.sentence_order_label.tolist() == [pair.label for pair in pairs]


# --- masking --------------------------------------------------------------------------------------


def test_masking_statistics(tiny_vocab: Vocabulary) -> None:
    generator = torch.Generator().manual_seed(0)
    source = torch.Generator().manual_seed(1)
    selected = maskable = to_mask = to_random = kept = 0
    for _ in range(50):
        ids = torch.randint(5, tiny_vocab.size, (32, 64), generator=source)
        lengths = torch.randint(10, 64, (32,), generator=source)
        ids[:, 0] = tiny_vocab.cls
        for row, length in enumerate(lengths.tolist()):
            ids[row, length // 2] = tiny_vocab.sep
            ids[row, length - 1] = tiny_vocab.sep
            ids[row, length:] = tiny_vocab.pad
        masked, labels = mask_tokens(ids, tiny_vocab, generator)
        special = (ids == tiny_vocab.cls) | (ids == tiny_vocab.sep) | (ids == tiny_vocab.pad)
        chosen = labels != IGNORE_INDEX
        assert not (chosen & special).any()
        assert torch.equal(masked[special], ids[special])
        assert torch.equal(labels[chosen], ids[chosen])
        assert torch.equal(masked[~chosen], ids[~chosen])
        selected += int(chosen.sum())
        maskable += int((~special).sum())
        to_mask += int((masked[chosen] == tiny_vocab.mask).sum())
        replaced = chosen & (masked != ids) & (masked != tiny_vocab.mask)
        to_random += int(replaced.sum())
        kept += int((chosen & (masked == ids)).sum())
        assert not torch.isin(masked[replaced], torch.tensor([0, 2, 3, 4])).any()
    assert abs(selected / maskable - 0.15) < 0.015
    # A random replacement may draw the original token (1 in ~4000): it then counts as kept.
    assert abs(to_mask / selected - 0.8) < 0.03
    assert abs(to_random / selected - 0.1) < 0.03
    assert abs(kept / selected - 0.1) < 0.03


# --- the batches of build_data --------------------------------------------------------------------


def test_batches(tiny_config: dict[str, Any], tiny_vocab: Vocabulary) -> None:
    data = ALBERT.build_data(tiny_config, 1, "train")
    batches = [next(data) for _ in range(40)]
    batch = batches[0]
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels", "sentence_order_label"}
    assert batch["input_ids"].shape == (16, 64)
    labels = torch.cat([b["sentence_order_label"] for b in batches]).float()
    assert abs(float(labels.mean()) - 0.5) < 0.1
    for b in batches:
        assert (b["input_ids"][:, 0] == tiny_vocab.cls).all()
        assert ((b["input_ids"] == tiny_vocab.sep) | (b["labels"] == tiny_vocab.sep)).sum(dim=1).eq(2).all()
    # Another peer (seed) reads other samples; eval is the same on every call for a seed.
    other = next(ALBERT.build_data(tiny_config, 2, "train"))
    assert not torch.equal(other["input_ids"], batch["input_ids"])
    first_eval = [next(iter_) for iter_ in [ALBERT.build_data(tiny_config, 1, "eval")] for _ in range(2)]
    again = ALBERT.build_data(tiny_config, 1, "eval")
    for expected in first_eval:
        got = next(again)
        assert all(torch.equal(got[key], expected[key]) for key in expected)

    # The background thread changes nothing in what a peer reads.
    unprefetched = ALBERT.build_data({**tiny_config, "data_prefetch": 0}, 1, "train")
    assert not isinstance(unprefetched, Prefetched) and isinstance(data, Prefetched)
    for expected in batches[:3]:
        got = next(unprefetched)
        assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_prefetching_keeps_order_raises_and_stops() -> None:
    def source() -> Iterator[int]:
        yield from range(5)
        raise ValueError("the corpus went away")

    prefetched = Prefetched(source(), depth=2)
    assert [next(prefetched) for _ in range(5)] == [0, 1, 2, 3, 4]
    for _ in range(2):
        with pytest.raises(ValueError, match="went away"):
            next(prefetched)
    endless = Prefetched(iter(range(1 << 30)), depth=2)
    assert next(endless) == 0
    thread = endless._thread
    del endless
    gc.collect()
    deadline = time.monotonic() + 5
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not thread.is_alive()
