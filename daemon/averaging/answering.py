"""A round's answers to its senders: each averaged chunk of our part, its account, sent back.

Once a chunk of our part is averaged (reducing.py), `compose` encodes the average once, writes it
into our own vector (decoded: the same values as everyone's) and keeps the bytes that `send` then
sends to every sender, chunk by chunk as they are ready (a chunk not averaged goes as a `skip`
that says why). The averages go back in the senders' codec, or in its `reply_codec` where that
differs (a sparse codec's averages are not sparse enough for it).

Where members check answers, each answer carries its account (accounts.py): every contribution's
weight, norm and projection onto signs drawn from the answer and every digest of the account, with
the digest and signature each sender sent its chunk with (`record_signature` checks and keeps
them) and our signature of the answer and account (signatures.py). Our own contribution is
committed to and kept for audits (audits.py). The round (butterfly.py) owns the tasks and the
thread pool's jobs: `record_signature` and `compose` may run in its worker threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..identity import Identity
from ..net import Message, Stream
from .accounts import (
    ACCOUNT_KEY,
    CLIPPED,
    Entry,
    account_header,
    answer_digest,
    codec_errors,
    measure,
    project,
    segments,
    signs_of,
)
from .aggregation import l2_norm
from .audits import Own, commitment
from .codec import Buffer, Codec, Meta
from .corruption import forged_entries, wrong_answer
from .group import Group
from .reducer import Contribution
from .report import TransferLog
from .screening import ScreeningPolicy
from .signatures import (
    ANSWER_SIGNATURE_KEY,
    LEADER_SIGNATURE_KEY,
    ROUND_KEY,
    contribution_digest,
    sign_answer,
    signed_by,
)
from .wire import ChunkPlan, ProtocolViolation, chunk_header


@dataclass
class PartAnswers:
    group: Group
    index: int
    vector: np.ndarray
    own: ChunkPlan | None  # our part (None: we reduce nothing)
    reply: Codec  # what the averages go back in
    senders: int  # how many members send (the account's segments)
    policy: ScreeningPolicy
    traffic: TransferLog
    left: Callable[[], float]  # the per-operation timeout (butterfly.Round._left)
    identity: Identity | None = None  # signs each answer and its account (signatures.py)
    round_name: str = ""  # what signatures name the round by (signatures.round_name)
    wrong_answers: str | None = None  # tests only (corruption.py)
    # per chunk: the answer's payload, meta, account and our signature of them
    results: list[tuple[Buffer, Meta, Any, str | None] | None] = field(init=False)
    unaveraged: dict[int, str] = field(default_factory=dict)
    done: list[asyncio.Event] = field(init=False)
    # (sender, chunk) -> the digest of its contribution and its signature (signatures.py)
    signed: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)
    # chunk -> our own contribution to it and its segments' digests, for audits (audits.py)
    own_kept: dict[int, Own] = field(default_factory=dict)
    # tests only (corruption.py, `equivocate`): per chunk what each member's account is cut from
    equivocal: dict[int, tuple[list[Entry], list[float], list[float], bytes, tuple[float, ...]]] = \
        field(default_factory=dict)
    # tests only (`forge_skip`): per chunk the sender sent a skip in place of the answer
    withheld_from: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        count = self.own.count if self.own else 0
        self.results = [None] * count
        self.done = [asyncio.Event() for _ in range(count)]

    def record_signature(self, i: int, c: int, meta: Meta, payload: Buffer, signature: Any) -> None:
        """Check sender i's signature of its chunk c and keep it: the account names it, members
        check the signature."""
        try:
            digest = contribution_digest(self.group.group_id, self.index, c, meta, payload)
        except (TypeError, ValueError) as exc:  # a meta JSON cannot carry (nested too deep)
            raise ProtocolViolation(f"chunk {c}: a codec meta that cannot be hashed: {exc}") \
                from None
        if not signed_by(self.group.members[i].peer_id, self.round_name, self.index, c,
                         digest, signature):
            raise ProtocolViolation(f"chunk {c} does not carry the sender's signature of it "
                                    "(a sender of an older dedloc?)")
        self.signed[(i, c)] = (digest.hex(), signature)

    def compose(self, c: int, average: np.ndarray, used: list[Contribution]) -> None:
        """Chunk c's answer: its average encoded for the senders and written into our vector,
        with what went into it (`used`) as its account, and our signature of them."""
        assert self.own is not None
        if self.wrong_answers is not None:
            wrong_answer(self.wrong_answers, average)
        payload, meta = self.reply.encode(average)
        a, b = self.own.absolute(c)
        self.reply.decode(payload, meta, b - a, out=self.vector[a:b])  # the same values as everyone's
        account: Any = None
        signature: str | None = None
        if self.policy.check_answers and self.policy.robust == "centered_clip":
            account = CLIPPED  # (not linear: no account can check it)
        elif self.policy.check_answers:  # what went into the answer, for the senders to check
            parts = segments(b - a, self.senders)
            signed = [self.signed.pop((u.sender, c), ("", "")) for u in used]
            for k, u in enumerate(used):
                if u.sender == self.index:  # our own: committed to, kept for audits (audits.py)
                    root, own = commitment(self.group.group_id, self.index, c,
                                           np.array(u.values), parts)
                    self.own_kept[c] = own
                    signed[k] = (root, "")
            # (the signs come after every contribution is fixed, ours included)
            answer = answer_digest(self.group.group_id, self.index, c, meta, payload,
                                   [digest for digest, _ in signed])
            r = signs_of(answer, b - a)
            errors = [0.0] * len(parts) if self.reply.name == "none" else codec_errors(
                self.vector[a:b], average, parts)
            entries = [Entry(u.sender, u.weight, project(r, u.values, parts),
                             l2_norm(u.values) if u.norm is None else u.norm, *signature)
                       for u, signature in zip(used, signed, strict=True)]
            if self.wrong_answers in ("forge", "forge_own", "forge_skip"):
                forged = forged_entries(entries, [u.scale for u in used], self.index,
                                        measure(r, self.vector[a:b], parts)[0],
                                        own=self.wrong_answers == "forge_own")
                if self.wrong_answers == "forge_skip":  # tests only: skip the sender misstated
                    for e, f in zip(entries, forged, strict=True):
                        if e != f:
                            self.withheld_from[c] = e.sender
                entries = forged
            account = account_header(entries, errors)
            if self.identity is not None:
                signature = sign_answer(self.identity, self.round_name, self.index, c, answer, account)
            if self.wrong_answers == "equivocate":  # tests only: an account per member (send)
                self.equivocal[c] = (entries, [u.scale for u in used], errors, answer,
                                     measure(r, self.vector[a:b], parts)[0])
        self.results[c] = (payload, meta, account, signature)

    async def send(self, stream: Stream, peer: str) -> None:
        """Send every chunk's answer to the sender on `stream` as it is ready, then close it."""
        assert self.own is not None
        for c in range(self.own.count):
            await self.done[c].wait()
            result = self.results[c]
            if result is None or self.withheld_from.get(c) == self.group.index_of(peer):
                header: dict[str, Any] = {"c": c, "skip": self.unaveraged.get(c, "not averaged")}
                payload: Buffer = b""
            else:
                payload, meta, account, signature = result
                if c in self.equivocal:
                    account, signature = self._equivocal(c, peer)
                header = chunk_header(c, meta)
                if account is not None:
                    header[ACCOUNT_KEY] = account
                if signature is not None:
                    header[ANSWER_SIGNATURE_KEY] = signature
                    header[ROUND_KEY] = self.round_name
                    header[LEADER_SIGNATURE_KEY] = self.group.leader_signature
            await stream.send(Message(header, payload), timeout=self.left())
            self.traffic.sent(peer, len(payload))
        await stream.close()

    def _equivocal(self, c: int, peer: str) -> tuple[Any, str | None]:
        """TEST ONLY (`equivocate`): chunk c's account as told to `peer`: its own entry true,
        another sender's forged to agree with the (wrong) answer, signed."""
        entries, scales, errors, answer, projections = self.equivocal[c]
        account = account_header(forged_entries(entries, scales, self.index, projections,
                                                spare=self.group.index_of(peer)), errors)
        return account, None if self.identity is None else sign_answer(
            self.identity, self.round_name, self.index, c, answer, account)
