"""The all-reduce's stream protocol (method "avg.part"): pure header codecs and the chunk plan.

Sender i opens one stream to each reducer j != i whose part is not empty, with the header
    {"g": group_id, "i": i (the sender's member index), "w": its weight, "d": round deadline}
Sender -> reducer: one message per chunk c of part j, in order c = 0, 1, ...:
    header {"c": c, "m": codec meta (left out when empty)}, payload: the encoded chunk (raw bytes);
    then the sender closes its side.
Reducer -> sender, on the same stream: the averaged chunks, in the same order and the same format
(one encoding per chunk, the same bytes to every sender; the codec is the senders' own, or its
`compression.reply_codec` for a sparse one), then the reducer closes its side.
A reducer that refuses a stream or excludes its sender (bad chunk, unknown group, too slow) aborts
the stream; the abort reason says why. A sender that stops early aborts or closes its side.
A stream that comes before its round has started at the reducer waits there for a while, in one
of a bounded number of slots; when there is none free the reducer refuses it with
`RoundNotStarted` (the abort reason begins with that name) and the sender opens it again shortly,
for up to `NOT_STARTED_PATIENCE` seconds (until the round's deadline when the stream had a slot
and lost it to another sender's: `SLOT_TAKEN`): strangers holding every waiting slot delay an
honest sender until the round starts at the reducer, they do not take its part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import AveragingError

METHOD = "avg.part"


class PeerFault(AveragingError):
    """A peer broke the all-reduce protocol (bad header, bad chunk, wrong order, ...)."""


class RoundNotStarted(PeerFault):
    """The reducer has no round of that group yet and no slot for the stream to wait in: the
    sender may open the stream again shortly."""


NOT_STARTED_PATIENCE = 5.0  # how long a sender keeps opening a stream refused as RoundNotStarted
# the reason of a `RoundNotStarted` for a stream that held a waiting slot and lost it to another
# sender's stream: its sender asks again until the round's deadline, not only its patience (the
# stream had been admitted: it was not late)
SLOT_TAKEN = ("this stream's waiting slot went to another peer's stream (the round has not "
              "started here); ask again shortly")


def says_not_started(error: BaseException) -> bool:
    """Whether a stream's abort says the reducer refused it as `RoundNotStarted`."""
    return f"{RoundNotStarted.__name__}:" in str(error)


def says_slot_taken(error: BaseException) -> bool:
    """Whether a stream's abort (or the refusal itself) says it lost its waiting slot."""
    return SLOT_TAKEN in str(error)


class GroupMismatch(PeerFault):
    """The peer names the round by another group than ours under the same id (signatures.
    round_name): its leader, not the peer, may have sent us different groups. What it sent is
    set aside; not an offence (screening.offence_kind), and never a ban."""


class ProtocolViolation(PeerFault):
    """A sender's chunk message breaks the protocol (no index, out of order, duplicate, bad meta):
    an offence, unlike a fault of the link."""


@dataclass(frozen=True)
class ChunkPlan:
    """Part [start, end) of the vector, cut into chunks of `chunk_elements` (the last may be short)."""

    start: int
    end: int
    chunk_elements: int

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def count(self) -> int:
        return -(-self.size // self.chunk_elements)

    @property
    def largest(self) -> int:
        return min(self.size, self.chunk_elements)

    def relative(self, index: int) -> tuple[int, int]:
        """Chunk `index` as a range within the part."""
        first = index * self.chunk_elements
        return first, min(first + self.chunk_elements, self.size)

    def absolute(self, index: int) -> tuple[int, int]:
        """Chunk `index` as a range of the whole vector."""
        first, last = self.relative(index)
        return self.start + first, self.start + last


@dataclass(frozen=True)
class StreamOpen:
    """What a sender says when it opens its stream to a reducer."""

    group_id: str
    sender: int
    weight: float
    deadline: float
    # the round as the sender's group names it, and its leader's signature of that name
    # (signatures.py): a reducer told another group under this id sets the stream aside
    # rather than count the sender an offence for a weight its leader may have changed
    round_name: str = ""
    leader_signature: str = ""

    def header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"g": self.group_id, "i": self.sender, "w": self.weight,
                                  "d": self.deadline}
        if self.round_name:
            header.update(r=self.round_name, l=self.leader_signature)
        return header

    @classmethod
    def parse(cls, header: dict[str, Any]) -> StreamOpen:
        group_id, sender = header.get("g"), header.get("i")
        weight, deadline = header.get("w"), header.get("d")
        if not isinstance(group_id, str) or not group_id or len(group_id) > 200:
            raise PeerFault("stream header without a group id")
        if isinstance(sender, bool) or not isinstance(sender, int) or sender < 0:
            raise PeerFault("stream header without a member index")
        for name, value in (("weight", weight), ("deadline", deadline)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise PeerFault(f"stream header with a bad {name}")
        if weight <= 0:  # type: ignore[operator]
            raise PeerFault("a sender's weight must be positive")
        name, signature = header.get("r", ""), header.get("l", "")
        if not isinstance(name, str) or len(name) > 64 or not isinstance(signature, str) \
                or len(signature) > 128:
            raise PeerFault("stream header with a bad round name or leader signature")
        return cls(group_id, sender, float(weight), float(deadline),  # type: ignore[arg-type]
                   name, signature)


def chunk_header(index: int, meta: dict[str, Any]) -> dict[str, Any]:
    return {"c": index, "m": meta} if meta else {"c": index}


def parse_chunk(header: dict[str, Any], expected: int, count: int) -> dict[str, Any]:
    """The codec meta of chunk `expected` (chunks come in order); PeerFault for anything else."""
    index = header.get("c")
    if isinstance(index, bool) or not isinstance(index, int):
        raise ProtocolViolation("chunk message without a chunk index")
    if index != expected:
        if 0 <= index < expected:
            raise ProtocolViolation(f"duplicate chunk {index}")
        if index < 0 or index >= count:
            raise ProtocolViolation(f"unknown chunk index {index} (the part has {count} chunks)")
        raise ProtocolViolation(f"chunk {index} out of order (expected {expected})")
    meta = header.get("m", {})
    if not isinstance(meta, dict):
        raise ProtocolViolation(f"chunk {index}: codec meta is not an object")
    return meta
