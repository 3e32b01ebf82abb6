"""Re-keying a closed run on revocation (pure parts: the key ring, tokens, the ledger, the
re-keying records and a member's reading of them). The swarm test
(tests/sim/test_rekeying_swarm.py) runs them over the real protocol."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import math
import stat
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from structlog.testing import capture_logs

from dedloc.daemon.collab import ownership
from dedloc.daemon.collab.errors import MembershipError
from dedloc.daemon.collab.membership import MembershipRegistry, NotAMember, namespace, rekey_key
from dedloc.daemon.collab.ownership import OwnedRuns
from dedloc.daemon.collab.rekeying import (
    CHUNK_MOST,
    MAX_REKEYED_PEERS,
    REKEY_GRACE,
    KeyCatchUp,
    RekeyError,
    chunk_of,
    open_chunk,
    plan_chunks,
    publish_rekeying,
    seal_chunks,
)
from dedloc.daemon.collab.revocations import MAX_REKEY_CHUNKS, Revocations
from dedloc.daemon.collab.secrecy import (
    KEPT_GENERATIONS,
    MAX_GENERATION,
    RecordUnreadable,
    RunKeys,
    RunSecret,
)
from dedloc.daemon.collab.tokens import MembershipToken
from dedloc.daemon.dht.errors import RecordTooLarge
from dedloc.daemon.dht.records import Entry, Record, RecordLimits
from dedloc.daemon.identity import Identity
from dedloc.daemon.sealing import SEAL_OVERHEAD

OWNER = Identity.from_seed(b"o" * 32)
MEMBERS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(6)]
RUN = namespace("club", OWNER.peer_id)
PROGRESS = f"{RUN}/abc/progress"


# --- the key ring ----------------------------------------------------------------------------


def test_a_member_reads_every_generation_it_holds_and_writes_the_new_one_after_the_grace() -> None:
    old, new = RunSecret.generate(), RunSecret.generate()
    keys = RunKeys(0, [old])
    before = old.encrypt("w", PROGRESS, "w", b"before")
    assert keys.learn(1, [new, old], now=100.0, grace=60.0)
    assert not keys.learn(1, [new, old], now=101.0, grace=60.0)  # (not newer: nothing moves)
    assert keys.newest == 1 and keys.writer(159.0) is old  # others may not hold it yet
    assert keys.writer(160.0) is new and keys.writing == 1
    after = keys.writer(161.0).encrypt("w", PROGRESS, "w", b"after")
    assert keys.decrypt("w", PROGRESS, "w", before) == b"before"  # (by key id)
    assert keys.decrypt("w", PROGRESS, "w", after) == b"after"
    with pytest.raises(RecordUnreadable, match="another key"):  # the old generation alone
        RunKeys(0, [old]).decrypt("w", PROGRESS, "w", after)
    with pytest.raises(RecordUnreadable, match="not learned yet"):
        RunKeys(0, [old]).decrypt("w", PROGRESS, "w", after)


def test_the_key_ring_is_bounded() -> None:
    secrets = [RunSecret.generate() for _ in range(KEPT_GENERATIONS + 5)]
    keys = RunKeys(0, [secrets[0]])
    for generation in range(1, len(secrets)):
        keys.learn(generation, [secrets[generation]], now=0.0, grace=0.0)
    assert len(keys.generations()) == KEPT_GENERATIONS
    assert keys.generations()[-1] == len(secrets) - 1 and keys.writing == keys.newest
    # many at once during a grace (a burst of revocations): the one written with is kept
    # until the switch (an owner whose records are not stored yet writes with it meanwhile)
    keys = RunKeys(0, [secrets[0]])
    for generation in range(1, KEPT_GENERATIONS + 3):
        keys.learn(generation, secrets[generation:generation + 1], now=0.0, grace=math.inf)
    assert keys.writing == 0 and keys.writer(1e9) is secrets[0]
    assert keys.generations() == [0, *range(3, KEPT_GENERATIONS + 3)]
    keys.learn(KEPT_GENERATIONS + 2, secrets[KEPT_GENERATIONS + 2:KEPT_GENERATIONS + 3], now=0.0,
               grace=60.0, rekeyed=-100.0)  # (stored long ago: it switches at once)
    assert keys.writing == KEPT_GENERATIONS + 2 and 0 not in keys.generations()
    for generation, given in ((-1, secrets[:1]), (MAX_GENERATION + 1, secrets[:1]), (3, []),
                              (20, secrets[:KEPT_GENERATIONS + 1])):
        with pytest.raises(ValueError, match="out of bounds"):
            keys.learn(generation, given, now=0.0, grace=0.0)


# --- tokens ----------------------------------------------------------------------------------


def test_a_token_carries_its_generation_and_the_one_before() -> None:
    old, new = RunSecret.generate(), RunSecret.generate()
    member = MEMBERS[0]
    token = MembershipToken.decode(MembershipToken.issue(
        OWNER, "club", member.peer_id, "trainer", 60.0, new, generation=4, earlier=[old]).encode())
    assert token.generation == 4
    assert [s.secret for s in token.run_keys(member)] == [new.secret, old.secret]
    registry = MembershipRegistry(member)
    registry.hold(token)
    keys = registry.keys(OWNER.peer_id, "club")
    assert keys is not None and (keys.newest, keys.writing, keys.generations()) == (4, 4, [3, 4])
    # The generation is signed: changing it breaks the owner's signature.
    forged = dataclasses.replace(token, generation=9)
    with pytest.raises(MembershipError, match="not signed"):
        MembershipToken.decode(forged.encode())
    # A generation-0 token is as tokens were before (no claim): those stay valid.
    first = MembershipToken.issue(OWNER, "club", member.peer_id, "trainer", 60.0, old)
    claims = orjson.loads(base64.urlsafe_b64decode(first.encode().split(".")[1] + "=="))
    assert "generation" not in claims
    assert MembershipToken.decode(first.encode()).run_secret(member).secret == old.secret


def test_a_token_with_a_generation_out_of_bounds_is_refused() -> None:
    token = MembershipToken.issue(OWNER, "club", MEMBERS[0].peer_id, "trainer", 60.0,
                                  RunSecret.generate(), generation=1)
    for generation in (-1, MAX_GENERATION + 1, True, 1.5):
        bad = dataclasses.replace(token, generation=generation)  # type: ignore[arg-type]
        bad = dataclasses.replace(bad, signature=OWNER.sign(bad.signing_bytes()))
        with pytest.raises(MembershipError, match="fields are wrong"):
            MembershipToken.decode(bad.encode())


# --- the revocation list ---------------------------------------------------------------------


def test_the_revocation_list_names_the_generation_and_checks_it() -> None:
    listed = Revocations(OWNER.peer_id, "club", 5.0, frozenset({"ab"}), frozenset(), 3, 2)
    assert Revocations.from_bytes(listed.to_bytes(), OWNER.peer_id, "club") == listed
    older = orjson.dumps({"owner": OWNER.peer_id, "run": "club", "version": 1.0})
    assert Revocations.from_bytes(older, OWNER.peer_id, "club").generation == 0
    base = orjson.loads(listed.to_bytes())
    for generation, chunks in ((-1, 1), (MAX_GENERATION + 1, 1), (True, 1), (2, 0), (0, 2),
                               (2, MAX_REKEY_CHUNKS + 1), ("2", 1), (2, 1.0)):
        data = orjson.dumps({**base, "generation": generation, "chunks": chunks})
        with pytest.raises(MembershipError, match="malformed"):
            Revocations.from_bytes(data, OWNER.peer_id, "club")


def test_only_the_owner_writes_the_rekeying_records_and_only_members_read_them() -> None:
    member = MembershipRegistry(MEMBERS[0])
    secret = RunSecret.generate()
    token = MembershipToken.issue(OWNER, "club", MEMBERS[0].peer_id, "trainer", 600.0, secret)
    member.hold(token)
    key = rekey_key(OWNER.peer_id, "club", 0)
    assert member.conceal(key, OWNER.peer_id, b"boxes") == b"boxes"  # (the boxes are sealed)
    entry = Entry.create(OWNER, key, b"boxes", time.time() + 60, OWNER.peer_id)
    assert member.reveal(entry) is entry.value
    member.authorize_write(OWNER.peer_id, key, None)
    with pytest.raises(NotAMember, match="only the run's owner writes"):
        member.authorize_write(MEMBERS[0].peer_id, key, token.encode())
    member.authorize_read(MEMBERS[0].peer_id, key, token.encode())
    with pytest.raises(NotAMember):
        member.authorize_read(MEMBERS[1].peer_id, key, None)


# --- the owner's ledger ----------------------------------------------------------------------


def test_a_revocation_draws_a_new_generation_that_outlives_a_restart(tmp_path: Path) -> None:
    told: list[tuple[int, list[bytes], float, float | None]] = []

    def listener(run: str, generation: int, secrets: list[RunSecret], grace: float,
                 rekeyed: float | None) -> None:
        told.append((generation, [s.secret for s in secrets], grace, rekeyed))

    owned = OwnedRuns(OWNER, tmp_path / "owned", on_keys=listener)
    first = owned.issue("club", MEMBERS[0].peer_id, "trainer", 1.0)
    owned.issue("club", MEMBERS[1].peer_id, "trainer", 1.0)
    gen0 = owned.ledger("club").secret
    listed = owned.revoke("club", first.serial, None)
    ledger = owned.ledger("club")
    assert (listed.generation, listed.chunks) == (1, 1) and ledger.generation == 1
    assert ledger.secret.secret != gen0.secret
    # (the owner writes with it only once its re-keying records were stored: not yet)
    assert told[-1] == (1, [ledger.secret.secret, gen0.secret], math.inf, None)
    assert ledger.members(time.time(), ledger.generation) == [MEMBERS[1].peer_id]
    # tokens issued from now on carry it (and the one before)
    later = owned.issue("club", MEMBERS[2].peer_id, "aux", 1.0)
    assert later.generation == 1
    assert [s.secret for s in later.run_keys(MEMBERS[2])] == [ledger.secret.secret, gen0.secret]
    path = tmp_path / "owned" / "club.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = OwnedRuns(OWNER, tmp_path / "owned", on_keys=listener)
    reloaded = again.ledger("club")
    assert reloaded.generation == 1 and reloaded.chunks == 1
    assert [s.secret for s in reloaded.newest_first()] == [ledger.secret.secret, gen0.secret]
    assert told[-1] == (1, [ledger.secret.secret, gen0.secret], math.inf, None)
    # A revocation that fails changes nothing; the generations kept are bounded.
    with pytest.raises(MembershipError, match="no token of run 'club' has serial"):
        again.revoke("club", "feed", None)
    assert again.ledger("club").generation == 1
    for _ in range(KEPT_GENERATIONS + 2):
        again.revoke("club", None, MEMBERS[5].peer_id)
    assert len(again.ledger("club").secrets) == KEPT_GENERATIONS
    assert OwnedRuns(OWNER, tmp_path / "owned").ledger("club").generation == KEPT_GENERATIONS + 3


def test_a_ledger_with_generations_out_of_bounds_is_not_replaced(tmp_path: Path) -> None:
    directory = tmp_path / "owned"
    OwnedRuns(OWNER, directory).ledger("club")
    data = orjson.loads((directory / "club.json").read_bytes())
    for bad in ({"generation": -1}, {"generation": 2, "chunks": 1, "earlier": {"5": data["secret"]}},
                {"generation": 1, "chunks": MAX_REKEY_CHUNKS + 1},
                {"generation": 2, "chunks": 1, "earlier": {"0": data["secret"]}}):  # (a gap)
        (directory / "club.json").write_bytes(orjson.dumps({**data, **bad}))
        before = (directory / "club.json").read_bytes()
        owned = OwnedRuns(OWNER, directory)
        with pytest.raises(MembershipError, match="could not be read: restore it"):
            owned.ledger("club")
        assert (directory / "club.json").read_bytes() == before


def test_the_owner_is_refused_more_members_than_a_revocation_can_rekey(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ownership, "MAX_REKEYED_PEERS", 2)
    owned = OwnedRuns(OWNER, tmp_path / "owned")
    owned.issue("club", MEMBERS[0].peer_id, "trainer", 1.0)
    owned.issue("club", MEMBERS[1].peer_id, "trainer", 1.0)
    owned.issue("club", MEMBERS[1].peer_id, "trainer", 2.0)  # (the same peer again)
    with pytest.raises(RekeyError, match=r"as many as a revocation can re-key: revoke"):
        owned.issue("club", MEMBERS[2].peer_id, "trainer", 1.0)
    owned.revoke("club", None, MEMBERS[0].peer_id)
    owned.issue("club", MEMBERS[2].peer_id, "trainer", 1.0)


# --- the re-keying records -------------------------------------------------------------------


def _records(generation: int, secrets: list[RunSecret], members: list[Identity]) -> list[bytes]:
    peers = [m.peer_id for m in members]
    return seal_chunks(OWNER.peer_id, "club", generation, secrets, peers, plan_chunks(peers))


def test_each_member_opens_its_own_entry_and_nobody_else_does() -> None:
    new, old = RunSecret.generate(), RunSecret.generate()
    staying, revoked = MEMBERS[:4], MEMBERS[4]
    values = _records(3, [new, old], staying)
    assert len(values) == 1 and len(values[0]) < 13 + 4 * (8 + SEAL_OVERHEAD + 64) + 1
    for member in staying:
        opened = open_chunk(member, OWNER.peer_id, "club", values[0], 0, 1)
        assert opened is not None and opened[0] == 3
        assert [s.secret for s in opened[1]] == [new.secret, old.secret]
        assert new.secret not in values[0]
    assert open_chunk(revoked, OWNER.peer_id, "club", values[0], 0, 1) is None
    # bound to the owner and run (a box moved to another run's records does not open)
    assert open_chunk(staying[0], OWNER.peer_id, "other", values[0], 0, 1) is None
    # and to the generation: a record whose header claims another one opens for nobody
    altered = values[0][:4] + (9).to_bytes(4, "big") + values[0][8:]
    assert open_chunk(staying[0], OWNER.peer_id, "club", altered, 0, 1) is None


def test_malformed_rekeying_records_are_refused() -> None:
    value = _records(2, [RunSecret.generate()], MEMBERS[:2])[0]
    member = MEMBERS[0]
    for bad, reason in ((b"", "too short"), (b"dlk9" + value[4:], "known format"),
                        (value[:4] + bytes(4) + value[8:], "known format"),
                        (value[:12] + b"\x00" + value[13:], "secrets in a box"),
                        (value[:12] + b"\x09" + value[13:], "secrets in a box"),
                        (value[:-1], "not at most"), (value + bytes(7), "not at most")):
        with pytest.raises(MembershipError, match=reason):
            open_chunk(member, OWNER.peer_id, "club", bad, 0, 1)
    with pytest.raises(MembershipError, match="filed as 1 of 2"):
        open_chunk(member, OWNER.peer_id, "club", value, 1, 2)


def test_rekeying_records_are_bounded() -> None:
    entry = 8 + SEAL_OVERHEAD + 2 * 32
    assert 13 + CHUNK_MOST * entry <= RecordLimits().max_value_bytes
    peers = [f"peer-{i}" for i in range(MAX_REKEYED_PEERS)]  # (chunk_of only hashes them)
    chunks = plan_chunks(peers)
    assert chunks <= MAX_REKEY_CHUNKS
    counts = [0] * chunks
    for peer in peers:
        counts[chunk_of(peer, chunks)] += 1
    assert max(counts) <= CHUNK_MOST
    assert plan_chunks(peers[:10]) == 1
    with pytest.raises(RekeyError, match="more than the 8192 that a revocation can re-key"):
        plan_chunks([*peers, "one-more"])


# --- a member learns the new generation --------------------------------------------------------


class _Dht:
    """Answers `get` with whatever the test put under a key."""

    def __init__(self) -> None:
        self.records: dict[str, Record | Exception] = {}

    async def get(self, key: str, **_: Any) -> Record | None:
        found = self.records.get(key)
        if isinstance(found, Exception):
            raise found
        return found


def _stored(writer: Identity, key: str, value: bytes, sub_key: str | None = None) -> Record:
    return Record(key, (Entry.create(writer, key, value, time.time() + 600,
                                     sub_key or writer.peer_id),))


async def test_a_member_learns_the_new_generation_from_its_entry_and_checks_what_it_reads() -> None:
    member = MEMBERS[0]
    old, new = RunSecret.generate(), RunSecret.generate()
    registry = MembershipRegistry(member)
    registry.hold(MembershipToken.issue(OWNER, "club", member.peer_id, "trainer", 600.0, old))
    dht = _Dht()
    catch_up = KeyCatchUp(dht, registry, OWNER.peer_id, "club")  # type: ignore[arg-type]
    assert not await catch_up.step()  # (no list yet)
    registry.learn(Revocations(OWNER.peer_id, "club", 5.0, frozenset({"x"}), frozenset(), 1, 1))
    key = rekey_key(OWNER.peer_id, "club", 0)
    good = _records(1, [new, old], MEMBERS[:3])[0]
    hostile = [
        (TimeoutError("slow"), "unreachable"),
        (None, "missing"),
        (_stored(MEMBERS[1], key, good, OWNER.peer_id), "missing"),  # (not the owner's entry)
        (_stored(MEMBERS[1], key, good), "missing"),  # (another writer's sub-key)
        (_stored(OWNER, key, b"dlk1 garbage"), "malformed"),
        (_stored(OWNER, key, _records(1, [new], MEMBERS[1:3])[0]), "no_entry"),
    ]
    with capture_logs() as logs:
        for stored, _ in [*hostile, *hostile]:
            if stored is None:
                dht.records.pop(key, None)
            else:
                dht.records[key] = stored
            assert not await catch_up.step()
    reasons = [reason for _, reason in hostile]
    assert catch_up.problems == {r: 2 * reasons.count(r) for r in reasons}
    assert sorted(e["reason"] for e in logs if e["event"] == "rekey_not_learned") == sorted(
        set(reasons))  # (once each a generation)
    keys = registry.keys(OWNER.peer_id, "club")
    assert keys is not None and keys.newest == 0
    dht.records[key] = _stored(OWNER, key, good)
    assert await catch_up.step()
    assert keys.newest == 1 and keys.writing == 0  # it writes with it after the grace
    assert keys.writer(time.time() + REKEY_GRACE + 1) is keys.secret(1)
    assert keys.secret(1) is not None and keys.secret(1).secret == new.secret  # type: ignore[union-attr]
    assert not await catch_up.step()  # (nothing newer named)
    # an older record that a node still serves after the next generation is named: not taken
    registry.learn(Revocations(OWNER.peer_id, "club", 6.0, frozenset({"x"}), frozenset(), 2, 1))
    assert not await catch_up.step() and catch_up.problems["stale"] == 1


class _StoringDht:
    """Keeps what is stored; refuses values over `largest` as a DHT node would."""

    def __init__(self, largest: int = 1 << 16) -> None:
        self.largest = largest
        self.stored: dict[tuple[str, str | None], bytes] = {}

    async def store(self, key: str, value: bytes, expiration: float, sub_key: str | None = None,
                    **_: Any) -> int:
        if len(value) > self.largest:
            raise RecordTooLarge(f"value of {len(value)} bytes")
        self.stored[(key, sub_key)] = value
        return 1


async def test_the_owner_publishes_each_record_under_its_own_sub_key_and_says_when_it_cannot() -> None:
    secrets, peers = [RunSecret.generate()], [m.peer_id for m in MEMBERS]
    dht = _StoringDht()
    assert await publish_rekeying(dht, OWNER.peer_id, "club", 1, secrets, peers, 2,  # type: ignore[arg-type]
                                  time.time() + 60)
    assert set(dht.stored) == {(rekey_key(OWNER.peer_id, "club", n), OWNER.peer_id) for n in (0, 1)}
    for member in MEMBERS:
        chunk = chunk_of(member.peer_id, 2)
        value = dht.stored[(rekey_key(OWNER.peer_id, "club", chunk), OWNER.peer_id)]
        assert open_chunk(member, OWNER.peer_id, "club", value, chunk, 2) is not None
    with capture_logs() as logs:
        assert not await publish_rekeying(_StoringDht(largest=100), OWNER.peer_id, "club", 1,  # type: ignore[arg-type]
                                          secrets, peers, 2, time.time() + 60)
    (failed,) = [e for e in logs if e["event"] == "rekey_publish_failed"]
    assert "dht.max_value_bytes" in failed["hint"]


# --- when a member switches (the grace runs from when the owner stored the records) --------------


def test_the_grace_runs_from_when_the_records_were_stored_bounded_by_our_clock() -> None:
    old, new = RunSecret.generate(), RunSecret.generate()
    # stored days ago (a member restarted, or back from a long absence): at once
    keys = RunKeys(0, [old])
    keys.learn(1, [new, old], now=1e6, grace=60.0, rekeyed=1e6 - 86400.0)
    assert keys.writing == 1 and keys.writer(1e6) is new
    # stored 50 s ago: 10 s from now
    keys = RunKeys(0, [old])
    keys.learn(1, [new, old], now=1000.0, grace=60.0, rekeyed=950.0)
    assert keys.writer(1009.0) is old and keys.writer(1010.0) is new
    # an owner's clock ahead of ours (stored "in the future"): a full grace from now, no more
    keys = RunKeys(0, [old])
    keys.learn(1, [new, old], now=1000.0, grace=60.0, rekeyed=5000.0)
    assert keys.writer(1059.0) is old and keys.writer(1060.0) is new
    # unknown (a list without it): a full grace from now; learning when brings it forward
    keys = RunKeys(0, [old])
    keys.learn(1, [new, old], now=1000.0, grace=60.0)
    assert keys.writer(1030.0) is old
    keys.learn(1, [new, old], now=1030.0, grace=60.0, rekeyed=900.0)
    assert keys.writer(1030.0) is new


def _member(generation: int = 0, secrets: list[RunSecret] | None = None,
            ) -> tuple[MembershipRegistry, _Dht, KeyCatchUp]:
    member = MEMBERS[0]
    registry = MembershipRegistry(member)
    secrets = secrets or [RunSecret.generate()]
    registry.hold(MembershipToken.issue(OWNER, "club", member.peer_id, "trainer", 1e6,
                                        secrets[0], generation=generation, earlier=secrets[1:]))
    dht = _Dht()
    return registry, dht, KeyCatchUp(dht, registry, OWNER.peer_id, "club")  # type: ignore[arg-type]


async def test_a_member_that_learns_an_old_rotation_late_writes_with_it_at_once() -> None:
    registry, dht, catch_up = _member()
    keys = registry.keys(OWNER.peer_id, "club")
    assert keys is not None
    new, old = RunSecret.generate(), keys.secret(0)
    assert old is not None
    key = rekey_key(OWNER.peer_id, "club", 0)
    dht.records[key] = _stored(OWNER, key, _records(1, [new, old], MEMBERS[:3])[0])
    registry.learn(Revocations(OWNER.peer_id, "club", 5.0, frozenset({"x"}), frozenset(), 1, 1,
                               new.key_id.hex(), time.time() - 3 * 86400.0))
    assert await catch_up.step()
    assert keys.writing == 1 and keys.writer(time.time()) is keys.secret(1)


async def test_a_member_that_cannot_learn_a_generation_past_its_grace_says_so_loudly() -> None:
    registry, _, catch_up = _member()
    registry.learn(Revocations(OWNER.peer_id, "club", 5.0, frozenset({"x"}), frozenset(), 1, 1,
                               RunSecret.generate().key_id.hex(), time.time() - 3600.0))
    with capture_logs() as logs:
        assert not await catch_up.step()
        assert not await catch_up.step()
    assert catch_up.problems["overdue"] == 2 and catch_up.problems["missing"] == 2
    (overdue,) = [e for e in logs if e["event"] == "rekey_overdue"]
    assert overdue["log_level"] == "error" and "new token" in overdue["hint"]
    # within the grace: not yet
    registry, _, catch_up = _member()
    registry.learn(Revocations(OWNER.peer_id, "club", 5.0, frozenset({"x"}), frozenset(), 1, 1,
                               "", time.time() - 1.0))
    assert not await catch_up.step() and catch_up.problems["overdue"] == 0


# --- a generation number drawn twice ------------------------------------------------------------


async def test_a_generation_drawn_twice_is_taken_from_the_newest_list_with_an_error() -> None:
    old, first, second = RunSecret.generate(), RunSecret.generate(), RunSecret.generate()
    registry, dht, catch_up = _member(1, [first, old])  # (holds generation 1 = first)
    keys = registry.keys(OWNER.peer_id, "club")
    assert keys is not None and keys.writer(time.time()).secret == first.secret
    key = rekey_key(OWNER.peer_id, "club", 0)
    # the owner's ledger went back and drew generation 1 again (second): its list says so
    registry.learn(Revocations(OWNER.peer_id, "club", 9.0, frozenset({"x"}), frozenset(), 1, 1,
                               second.key_id.hex(), time.time() - 10.0))
    # a node still serving the first's records is not believed
    dht.records[key] = _stored(OWNER, key, _records(1, [first, old], MEMBERS[:3])[0])
    with capture_logs() as logs:
        assert not await catch_up.step()
        assert catch_up.problems["stale"] == 1
        assert keys.writer(time.time()).secret == first.secret
        dht.records[key] = _stored(OWNER, key, _records(1, [second, old], MEMBERS[:3])[0])
        assert await catch_up.step()
    assert [e["log_level"] for e in logs if e["event"] == "rekey_conflict"] == ["error"]
    assert catch_up.problems["conflict"] == 2 and keys.conflicts == 1
    held = keys.secret(1)
    assert held is not None and held.secret == second.secret
    assert keys.writer(time.time()).secret == second.secret  # (at once: the owner's word)
    assert not await catch_up.step()  # (settled)


async def test_an_owner_whose_ledger_went_back_rekeys_above_what_the_members_hold(
        tmp_path: Path) -> None:
    directory = tmp_path / "owned"
    owned = OwnedRuns(OWNER, directory)
    token = owned.issue("club", MEMBERS[0].peer_id, "trainer", 1.0)
    owned.issue("club", MEMBERS[1].peer_id, "trainer", 1.0)
    backup = (directory / "club.json").read_bytes()
    owned.revoke("club", token.serial, None)
    dht = _OwnDht()
    assert await owned.publish(dht, "club")  # type: ignore[arg-type]
    published = owned.ledger("club").revocations()
    (directory / "club.json").write_bytes(backup)  # restored from the backup (generation 0)
    restored = OwnedRuns(OWNER, directory)
    with capture_logs() as logs:
        assert await restored.publish(dht, "club")  # type: ignore[arg-type]
    assert [e["log_level"] for e in logs if e["event"] == "owned_run_ledger_behind"] == ["error"]
    ledger = restored.ledger("club")
    assert ledger.generation == published.generation + 1 and ledger.version > published.version
    assert OwnedRuns(OWNER, directory).ledger("club").generation == ledger.generation  # (saved)
    # the list the members now read names it, and its records are there
    now = Revocations.from_bytes(dht.stored[("revoked", OWNER.peer_id)], OWNER.peer_id, "club")
    assert now.generation == ledger.generation and now.key_id == ledger.secret.key_id.hex()


# --- the owner's ledger: saved before it changes, members by generation --------------------------


def test_a_revocation_that_cannot_be_saved_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    owned = OwnedRuns(OWNER, tmp_path / "owned")
    token = owned.issue("club", MEMBERS[0].peer_id, "trainer", 1.0)
    secret = owned.ledger("club").secret

    def full(ledger: ownership.RunLedger) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(owned, "_save", full)
    with pytest.raises(OSError, match="No space"):
        owned.revoke("club", token.serial, None)
    ledger = owned.ledger("club")  # (no generation 1 drawn that a retry would draw again)
    assert (ledger.generation, ledger.revoked_serials, ledger.secret) == (0, set(), secret)
    with pytest.raises(OSError, match="No space"):
        owned.issue("club", MEMBERS[1].peer_id, "trainer", 1.0)
    assert len(owned.ledger("club").issued) == 1


def test_the_members_to_rekey_are_chosen_by_their_tokens_generation_not_the_clock(
        tmp_path: Path) -> None:
    owned = OwnedRuns(OWNER, tmp_path / "owned")
    owned.issue("club", MEMBERS[0].peer_id, "trainer", 1.0)
    owned.issue("club", MEMBERS[1].peer_id, "trainer", 1.0)
    owned.revoke("club", None, MEMBERS[5].peer_id)
    owned.issue("club", MEMBERS[2].peer_id, "trainer", 1.0)  # (carries generation 1)
    ledger = owned.ledger("club")
    # the owner's clock stepped back at the revocation: issue times say nothing of it
    for item in ledger.issued:
        item["issued"] = ledger.rotated + 1000.0
    ledger.issued[0].pop("generation")  # (a ledger written before tokens had generations)
    assert ledger.members(time.time(), ledger.generation) == sorted(
        m.peer_id for m in MEMBERS[:2])


def test_a_revocation_that_cannot_rekey_is_still_recorded_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dedloc.daemon.collab import rekeying
    owned = OwnedRuns(OWNER, tmp_path / "owned")
    tokens = [owned.issue("club", m.peer_id, "trainer", 1.0) for m in MEMBERS[:4]]
    monkeypatch.setattr(rekeying, "MAX_REKEYED_PEERS", 2)  # (a ledger from before the cap)
    with capture_logs() as logs:
        listed = owned.revoke("club", tokens[0].serial, None)
    assert tokens[0].serial in listed.serials and listed.generation == 0
    (logged,) = [e for e in logs if e["event"] == "token_revoked_without_rekeying"]
    assert logged["log_level"] == "error" and "still read" in logged["hint"]
    assert "revoke or let expire" in (owned.rekey_errors["club"] or "")
    assert tokens[0].serial in OwnedRuns(OWNER, tmp_path / "owned").ledger("club").revoked_serials


# --- the owner publishes until it is stored, then switches ---------------------------------------


class _OwnDht(_StoringDht):
    """Stores (failing the first `failures` stores) and answers the owner's list back."""

    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.failures = failures
        self.tries: list[float] = []

    async def store(self, key: str, value: bytes, expiration: float, sub_key: str | None = None,
                    **kwargs: Any) -> int:
        self.tries.append(asyncio.get_running_loop().time())
        if self.failures > 0:
            self.failures -= 1
            raise TimeoutError("no node answered")
        return await super().store(key.rsplit("/", 1)[-1] if key.endswith("/revoked") else key,
                                   value, expiration, sub_key)

    async def get(self, key: str, **_: Any) -> Record | None:
        value = self.stored.get(("revoked", OWNER.peer_id)) if key.endswith("/revoked") else None
        return None if value is None else _stored(OWNER, key, value)


@pytest.mark.virtual_time
async def test_a_failed_publish_is_retried_backing_off_and_the_owner_switches_after_it(
        tmp_path: Path) -> None:
    told: list[tuple[int, float, float | None]] = []
    owned = OwnedRuns(OWNER, tmp_path / "owned",
                      on_keys=lambda run, g, secrets, grace, rekeyed: told.append((g, grace, rekeyed)))
    owned.issue("club", MEMBERS[0].peer_id, "trainer", 1.0)
    owned.revoke("club", None, MEMBERS[5].peer_id)
    assert told[-1] == (1, math.inf, None)  # (nobody can learn it yet)
    dht = _OwnDht(failures=6)  # (a try stores one record, then the list)
    wake, loop = asyncio.Event(), asyncio.get_running_loop()
    start = loop.time()

    async def joined() -> Any:
        return dht

    task = asyncio.create_task(owned.keep_published(joined, wake, lambda: False))
    await asyncio.sleep(1000.0)  # (virtual time: this test's marker)
    # each try stores the records, then (if they failed) the list: 5, 10, 20 s apart
    tries = sorted({round(t - start) for t in dht.tries})
    assert tries[:4] == [0, 5, 15, 35], tries
    ledger = owned.ledger("club")
    assert ledger.rekeyed and told[-1] == (1, REKEY_GRACE, ledger.rekeyed)
    assert round(ledger.rekeyed - ledger.rotated) == 35  # (when they were first stored)
    listed = Revocations.from_bytes(dht.stored[("revoked", OWNER.peer_id)], OWNER.peer_id, "club")
    assert listed.rekeyed == ledger.rekeyed and listed.key_id == ledger.secret.key_id.hex()
    count = len(dht.tries)
    await asyncio.sleep(3600.0)  # (virtual time)
    assert len(dht.tries) == count  # (then every REPUBLISH_EVERY)
    wake.set()
    await asyncio.sleep(1.0)  # (virtual time)
    assert len(dht.tries) > count
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# --- versions -------------------------------------------------------------------------------------


def test_a_token_with_fields_of_a_newer_version_says_to_upgrade() -> None:
    token = MembershipToken.issue(OWNER, "club", MEMBERS[0].peer_id, "trainer", 60.0,
                                  RunSecret.generate(), generation=1)
    claims = {**token._claims(), "scope": "all"}
    signature = OWNER.sign(b"dedloc-run-token-v2\0" + orjson.dumps(claims,
                                                                     option=orjson.OPT_SORT_KEYS))
    text = ".".join(("dlt2", base64.urlsafe_b64encode(orjson.dumps(claims)).rstrip(b"=").decode(),
                     base64.urlsafe_b64encode(signature).rstrip(b"=").decode()))
    with pytest.raises(MembershipError, match=r"does not know \(scope\).*newer version.*Upgrade"):
        MembershipToken.decode(text)
