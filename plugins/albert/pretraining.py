"""ALBERT's pre-training examples: sentence pairs with sentence-order labels, packed and masked.

From each document (a list of tokenized sentences), consecutive sentences are gathered until they
reach a target length (`max_seq_length - 3` tokens; with probability `SHORT_SEQ_PROB` a random
shorter one, as BERT and ALBERT do), then cut at a random sentence boundary into segment A and
segment B (a chunk of a single sentence is cut inside it). With probability 1/2 the segments are
swapped: sentence-order label 0 is "A then B, in the document's order", 1 is "swapped". A pair
too long is trimmed from the start of A and the end of B, so that the two stay adjacent at the
boundary the label is about. Each example is `[CLS] A [SEP] B [SEP]` padded with [PAD] to
`max_seq_length`, with token type 0 up to the first [SEP] and 1 after it.

Masking is dynamic, drawn when a batch is made: of each sequence's maskable tokens (all but
[CLS], [SEP], [PAD]), 15% are chosen (`mlm_probability`; the count is rounded at random so that
the expected share is exact); of those, 80% become [MASK], 10% a random non-special token, 10%
stay. Labels hold the original ids at the chosen positions and -100 elsewhere.

Each peer walks the documents in its own order (its `seed`) and mixes examples of different
documents in a shuffle buffer.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from .corpus import Document
from .tokenizer import Vocabulary

SHORT_SEQ_PROB = 0.1
IGNORE_INDEX = -100

T = TypeVar("T")


@dataclass(frozen=True)
class Pair:
    """Two segments of token ids and the sentence-order label (0: in order, 1: swapped)."""

    first: list[int]
    second: list[int]
    label: int


def _trim(first: list[int], second: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Trim the longer segment until both fit `budget`: A loses its start, B its end."""
    excess = len(first) + len(second) - budget
    while excess > 0:
        if len(first) > len(second):
            cut = min(excess, len(first) - len(second))
            first = first[cut:]
        else:
            cut = min(excess, max(1, len(second) - len(first)))
            second = second[:len(second) - cut]
        excess -= cut
    return first, second


def _split(chunk: list[list[int]], rng: random.Random) -> tuple[list[int], list[int]] | None:
    if len(chunk) >= 2:
        boundary = rng.randint(1, len(chunk) - 1)
        return ([token for sentence in chunk[:boundary] for token in sentence],
                [token for sentence in chunk[boundary:] for token in sentence])
    tokens = chunk[0]
    if len(tokens) < 2:
        return None
    cut = rng.randint(1, len(tokens) - 1)
    return tokens[:cut], tokens[cut:]


def document_pairs(sentences: Sequence[list[int]], max_seq_length: int, rng: random.Random
                   ) -> Iterator[Pair]:
    """The sentence-order pairs of one tokenized document (see the module docstring)."""
    budget = max_seq_length - 3
    if budget < 2:
        raise ValueError(f"max_seq_length {max_seq_length} leaves no room for two segments")

    def target() -> int:
        return rng.randint(2, budget) if rng.random() < SHORT_SEQ_PROB else budget

    wanted = target()
    chunk: list[list[int]] = []
    length = 0
    kept = [sentence for sentence in sentences if sentence]
    for index, sentence in enumerate(kept):
        chunk.append(sentence)
        length += len(sentence)
        if length < wanted and index < len(kept) - 1:
            continue
        segments = _split(chunk, rng)
        chunk, length = [], 0
        wanted = target()
        if segments is None:
            continue
        first, second = _trim(*segments, budget)
        if rng.random() < 0.5:
            yield Pair(second, first, 1)
        else:
            yield Pair(first, second, 0)


@dataclass(frozen=True)
class Packed:
    """Examples as padded tensors, before masking."""

    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    attention_mask: torch.Tensor
    sentence_order_label: torch.Tensor


def pack(pairs: Sequence[Pair], max_seq_length: int, vocab: Vocabulary) -> Packed:
    """`[CLS] A [SEP] B [SEP]`, padded to `max_seq_length`, for each pair."""
    count = len(pairs)
    input_ids = torch.full((count, max_seq_length), vocab.pad, dtype=torch.long)
    token_type_ids = torch.zeros((count, max_seq_length), dtype=torch.long)
    attention_mask = torch.zeros((count, max_seq_length), dtype=torch.long)
    for row, pair in enumerate(pairs):
        ids = [vocab.cls, *pair.first, vocab.sep, *pair.second, vocab.sep]
        if len(ids) > max_seq_length:
            raise ValueError(f"a pair of {len(ids)} tokens does not fit max_seq_length {max_seq_length}")
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        token_type_ids[row, len(pair.first) + 2:len(ids)] = 1
        attention_mask[row, :len(ids)] = 1
    labels = torch.tensor([pair.label for pair in pairs], dtype=torch.long)
    return Packed(input_ids, token_type_ids, attention_mask, labels)


def mask_tokens(input_ids: torch.Tensor, vocab: Vocabulary, generator: torch.Generator,
                mlm_probability: float = 0.15, regular: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked input ids and MLM labels for a batch (see the module docstring). `input_ids` is kept.

    `regular`: the ids random replacements are drawn from (default: `regular_ids(vocab)`).
    """
    maskable = torch.ones_like(input_ids, dtype=torch.bool)
    for special in vocab.special_ids:
        maskable &= input_ids != special
    counts = maskable.sum(dim=1).double()
    # Stochastic rounding: each row masks floor(p·n + u) tokens, u uniform, so E[count] = p·n.
    wanted = (counts * mlm_probability + torch.rand(counts.shape, generator=generator,
                                                    dtype=torch.float64)).floor().long()
    scores = torch.rand(input_ids.shape, generator=generator)
    scores[~maskable] = 2.0  # after every maskable position
    ranks = scores.argsort(dim=1).argsort(dim=1)
    chosen = (ranks < wanted.unsqueeze(1)) & maskable
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    action = torch.rand(input_ids.shape, generator=generator)
    masked = input_ids.clone()
    masked[chosen & (action < 0.8)] = vocab.mask
    replace = chosen & (action >= 0.8) & (action < 0.9)
    if regular is None:
        regular = regular_ids(vocab)
    picks = torch.randint(len(regular), (int(replace.sum()),), generator=generator)
    masked[replace] = regular[picks]
    return masked, labels


def regular_ids(vocab: Vocabulary) -> torch.Tensor:
    """The ids a random replacement may take: every id of the tokenizer but the special ones."""
    special = set(vocab.special_ids)
    return torch.tensor([index for index in range(vocab.size) if index not in special], dtype=torch.long)


def _seed(*parts: object) -> int:
    return random.Random(":".join(map(str, parts))).getrandbits(63)


def examples(documents: Sequence[Document], vocab: Vocabulary, max_seq_length: int, seed: int,
             split: str, buffer_size: int) -> Iterator[Pair]:
    """Endless pairs: documents in this peer's order (one shuffle per pass), mixed in a buffer."""
    if not documents:
        raise ValueError("the corpus split has no documents")
    rng = random.Random(_seed("albert-examples", seed, split))
    buffer: list[Pair] = []
    while True:
        order = list(range(len(documents)))
        rng.shuffle(order)
        produced = 0
        for index in order:
            tokenized = vocab.encode(documents[index].sentences())
            for pair in document_pairs(tokenized, max_seq_length, rng):
                produced += 1
                if len(buffer) < buffer_size:
                    buffer.append(pair)
                    continue
                slot = rng.randrange(buffer_size)
                yield buffer[slot]
                buffer[slot] = pair
        if produced == 0:
            raise ValueError("the corpus split gives no sentence pairs (is the text empty?)")
        if len(buffer) < buffer_size:  # a pass gave fewer pairs than the buffer holds: drain it
            rng.shuffle(buffer)
            yield from buffer
            buffer.clear()


def batches(documents: Sequence[Document], vocab: Vocabulary, max_seq_length: int, batch_size: int,
            seed: int, split: str, mlm_probability: float = 0.15) -> Iterator[dict[str, torch.Tensor]]:
    """Endless masked batches: input_ids, token_type_ids, attention_mask, labels, sentence_order_label."""
    generator = torch.Generator().manual_seed(_seed("albert-masking", seed, split))
    regular = regular_ids(vocab)
    stream = examples(documents, vocab, max_seq_length, seed, split, buffer_size=max(256, 16 * batch_size))
    while True:
        packed = pack([next(stream) for _ in range(batch_size)], max_seq_length, vocab)
        input_ids, labels = mask_tokens(packed.input_ids, vocab, generator, mlm_probability, regular)
        yield {"input_ids": input_ids, "token_type_ids": packed.token_type_ids,
               "attention_mask": packed.attention_mask, "labels": labels,
               "sentence_order_label": packed.sentence_order_label}


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class Prefetched(Generic[T]):
    """The items of `source`, in order, made ahead by a daemon thread (at most `depth` waiting).

    Tokenizing and masking then overlap the training step (the tokenizer and torch release the
    GIL). An exception of `source` is raised by the `next` that would have returned its item. The
    thread ends when this iterator is closed or garbage-collected.
    """

    def __init__(self, source: Iterator[T], depth: int) -> None:
        self._queue: queue.Queue[T | _Failure] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(source, self._queue, self._stop),
                                        name="albert-data", daemon=True)
        self._thread.start()

    def __iter__(self) -> Prefetched[T]:
        return self

    def __next__(self) -> T:
        item = self._queue.get()
        if isinstance(item, _Failure):
            self._queue.put(item)  # every later call fails the same way
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()


def _produce(source: Iterator[T], out: queue.Queue[T | _Failure], stop: threading.Event) -> None:
    def put(item: T | _Failure) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in source:
            if not put(item):
                return
    except BaseException as exc:  # handed to the consumer, which raises it
        put(_Failure(exc))
        return
    put(_Failure(StopIteration()))
