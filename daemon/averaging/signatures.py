"""Signed contributions and answers: what senders and reducers sign in a round. No I/O.

A sender signs, with its peer identity (Ed25519), a digest (BLAKE3, 32 bytes) of each chunk it
sends: the codec meta and the payload bytes as they went out, for a slot named in the clear
(the round by `round_name`, the reducer, the chunk index). The signature travels in the chunk's
header (`SIGNATURE_KEY`); the reducer checks it before it adds the chunk and copies the digest and
the signature into its account (accounts.py). Members check every signature in an account, so a
reducer cannot list a sender that sent it nothing, nor another contribution than the one it got
there.

A leader signs the group it sends (`sign_group`: the round's name under its id), and every chunk
and answer carries that signature beside the round's name (`LEADER_SIGNATURE_KEY`). A leader that
tells two members different groups under one id has signed two names for that id, which no honest
leader does: a member that meets a chunk or an answer naming another round of its own group id,
with its leader's signature of that name, holds the proof and bans the leader at once
(`check_round_tag`: `offences_leader_equivocation`).

A reducer signs each answer: the answer's digest (the one its signs come from) and its account
(`ANSWER_SIGNATURE_KEY`). Members check it. A member whose own contribution the account
misstates shows the other members that account with the reducer's signature and the chunk it
signed itself (accusations.py): whatever the reducer told the others, its own signature proves
what it told this member.

Cost (measured on this machine): BLAKE3 at 4.9 GB/s per core (SHA-256: 1.4), over what each side
sends or receives, in the all-reduce's worker threads (it releases the GIL); an Ed25519 signature
28 us, a check 60-100 us: one per chunk and sender, and one per answer.
"""
from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping
from typing import Any

import orjson
from blake3 import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ..identity import Identity, public_key_of
from .bans import BanList
from .wire import GroupMismatch

SIGNATURE_KEY = "s"  # in a sender's chunk header: the hex signature of its digest
ANSWER_SIGNATURE_KEY = "a"  # in a reducer's answer header: its signature of answer and account
ROUND_KEY = "r"  # in both: the round as the writer's group names it (`round_name`)
LEADER_SIGNATURE_KEY = "l"  # in both: the writer's leader's signature of that name (`sign_group`)
DIGEST_HEX = 64
SIGNATURE_HEX = 128


def contribution_digest(group_id: str, reducer: int, chunk: int, meta: Mapping[str, Any],
                        payload: Any) -> bytes:
    """The digest a sender signs for chunk `chunk` of reducer `reducer`'s part in round
    `group_id`: the payload's bytes and meta as they went out."""
    digest = blake3(max_threads=1)
    digest.update(f"dedloc-contribution\0{group_id}\0{reducer}\0{chunk}\0".encode())
    # (the meta as JSON carries it, so that both ends hash the same bytes: a NaN goes as null)
    digest.update(orjson.dumps(dict(meta), option=orjson.OPT_SORT_KEYS))
    digest.update(b"\0")
    digest.update(memoryview(payload).cast("B"))
    return digest.digest()


def round_name(group: Any) -> str:
    """What signatures name a round by: a digest of its whole group (a Group) as its leader sent
    it: the id, every member with its role, weight, bandwidths and count, the parts, the codec,
    the deadline. Members of one group agree on it; a member that a hostile leader gave another
    group under the same id (another member's weight, say) names another round, which its peers
    see in the clear (`ROUND_KEY`) and set aside without blaming it (`GroupMismatch`): the
    signatures of that member and of its reducers then never meet, and nobody honest is
    banned for what the leader did."""
    body = orjson.dumps([
        group.group_id, group.key,
        [[m.peer_id, m.role, float(m.weight), float(m.upload), float(m.download),
          bool(m.reachable), int(m.represents)] for m in group.members],
        group.size, [[int(a), int(b)] for a, b in group.part_bounds], group.chunk_elements,
        group.compression, float(group.deadline), group.aggregation])
    return blake3(body, max_threads=1).hexdigest()


def _group_bytes(group_id: str, name: str) -> bytes:
    # (the id in the clear: a name is a digest, and a leader's signature of a name it gave
    # another round of ours, under another id, proves nothing)
    return f"dedloc-group-signature\0{group_id}\0{name}".encode()


def sign_group(identity: Identity, group_id: str, name: str) -> str:
    """A leader's signature of the group it sends under `group_id` (`name`: its `round_name`).
    An honest leader signs one name per id."""
    return identity.sign(_group_bytes(group_id, name)).hex()


def group_signed_by(leader: str, group_id: str, name: str, signature: Any) -> bool:
    """Whether `signature` is `leader`'s signature of round `name` under `group_id`."""
    return _verify(leader, _group_bytes(group_id, name), signature)


def check_round_tag(header: Mapping[str, Any], group: Any, name: str, writer: str,
                    counters: Counter[str], bans: BanList | None = None,
                    me: str | None = None) -> None:
    """GroupMismatch (counted as `group_mismatches`) where a signed chunk or answer names its
    round by another group than ours (`name`, of `group`), or by none (a peer of an older
    dedloc): set aside, and not an offence of the writer, since the leader may be the one that
    lied. Where it carries our leader's signature of its name under our group's id, the leader
    did lie: it signed two groups under one id. That is proof, and the leader (`group.leader`,
    unless it is us, `me`) is banned at once in `bans` (`offences_leader_equivocation`,
    counted as `leader_equivocations`). `writer`: "sender" or "reducer", for the message."""
    tag = header.get(ROUND_KEY)
    if tag == name:
        return
    counters["group_mismatches"] += 1
    leader = getattr(group, "leader", "")
    proven = (bans is not None and leader and leader != me and isinstance(tag, str)
              and len(tag) == DIGEST_HEX
              and group_signed_by(leader, group.group_id, tag, header.get(LEADER_SIGNATURE_KEY)))
    if proven:
        assert bans is not None
        if bans.banned(leader) is None:
            counters["leader_equivocations"] += 1
            bans.offence(leader, "leader_equivocation",
                         f"signed two groups under id {group.group_id[:16]} (a {writer} showed "
                         "the other)", conclusive=True)
        raise GroupMismatch(f"the {writer}'s group under this id is another than ours, and the "
                            f"leader {leader[:12]} signed both: banned for it")
    raise GroupMismatch(f"the {writer}'s group under this id is another than ours (round "
                        f"{str(tag)[:DIGEST_HEX]!r}, ours {name!r}): the leader sent us "
                        "different groups, or the writer lies about its own")


def _signed_bytes(kind: str, round_: str, reducer: int, chunk: int, *digests: bytes) -> bytes:
    """What is signed: the slot (round, reducer, chunk) in the clear beside the digests, so that
    whoever checks the signature checks the slot too (a reducer cannot put a sender's signature
    of one chunk in its account of another)."""
    return f"dedloc-{kind}-signature\0{round_}\0{reducer}\0{chunk}\0".encode() + b"".join(digests)


def sign(identity: Identity, round_: str, reducer: int, chunk: int, digest: bytes) -> str:
    """A sender's signature of its chunk's digest (`round_`: `round_name`)."""
    return identity.sign(_signed_bytes("contribution", round_, reducer, chunk, digest)).hex()


def account_json(account: Any) -> bytes:
    """An answer's account as JSON, keys sorted: what its digest is of (and what a member keeps
    of it, withheld.py)."""
    return orjson.dumps(account, option=orjson.OPT_SORT_KEYS)


def account_digest(account: Any, encoded: bytes | None = None) -> bytes:
    """The digest of an answer's account as JSON carries it (keys sorted; `encoded`: that JSON,
    where the caller has it already)."""
    return blake3(account_json(account) if encoded is None else encoded, max_threads=1).digest()


def sign_answer(identity: Identity, round_: str, reducer: int, chunk: int, answer: bytes,
                account: Any) -> str:
    """A reducer's signature of its answer to a chunk: the answer's digest (accounts.answer_digest,
    which its signs come from) and its account. A member shows it to prove what the reducer told
    it (accusations.py)."""
    return identity.sign(_signed_bytes("answer", round_, reducer, chunk, answer,
                                       account_digest(account))).hex()


def answer_signed_by(peer_id: str, round_: str, reducer: int, chunk: int, answer: bytes,
                     account: Any, signature: Any) -> bool:
    return answer_digests_signed_by(peer_id, round_, reducer, chunk, answer,
                                    account_digest(account), signature)


def answer_digests_signed_by(peer_id: str, round_: str, reducer: int, chunk: int, answer: bytes,
                             account: bytes, signature: Any) -> bool:
    """`answer_signed_by` from the account's digest (what members compare: answers.py)."""
    return _verify(peer_id, _signed_bytes("answer", round_, reducer, chunk, answer, account),
                   signature)


@functools.lru_cache(maxsize=1024)
def _key(peer_id: str) -> Ed25519PublicKey | None:
    try:
        return public_key_of(peer_id)
    except ValueError:
        return None


def signed_by(peer_id: str, round_: str, reducer: int, chunk: int, digest: bytes,
              signature: Any) -> bool:
    """Whether `signature` (hex text) is `peer_id`'s signature of `digest` for chunk `chunk` of
    reducer `reducer`'s part in round `round_` (`round_name`)."""
    return _verify(peer_id, _signed_bytes("contribution", round_, reducer, chunk, digest), signature)


def _verify(peer_id: str, message: bytes, signature: Any) -> bool:
    if not isinstance(signature, str) or len(signature) != SIGNATURE_HEX:
        return False
    key = _key(peer_id)
    if key is None:
        return False
    try:
        key.verify(bytes.fromhex(signature), message)
    except (InvalidSignature, ValueError):
        return False
    return True
