"""A closed run's records are encrypted with a run key that only its members hold (pure parts).

The attacker here holds what travels openly: the tokens (each with the run key sealed to its
peer) and the stored records (ciphertext, signed by their writers). It tries to open a token
meant for another peer, to alter a record, to move one to another key, sub-key or writer, and to
use an older token. The swarm test (tests/sim/test_closed_swarm.py) runs the same code over the
real protocol.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import stat
import time
from pathlib import Path

import orjson
import pytest

from dedloc.daemon.collab.errors import MembershipError
from dedloc.daemon.collab.membership import (
    MembershipRegistry,
    NotAMember,
    namespace,
    revocations_key,
)
from dedloc.daemon.collab.ownership import OwnedRuns
from dedloc.daemon.collab.secrecy import MAGIC, RECORD_OVERHEAD, RecordUnreadable, RunSecret
from dedloc.daemon.collab.tokens import MembershipToken
from dedloc.daemon.dht.records import Entry
from dedloc.daemon.identity import Identity
from dedloc.daemon.sealing import seal

OWNER = Identity.from_seed(b"o" * 32)
MEMBER = Identity.from_seed(b"m" * 32)
OTHER = Identity.from_seed(b"x" * 32)
RUN = namespace("club", OWNER.peer_id)


# --- the record cipher -----------------------------------------------------------------------


def test_a_record_opens_under_its_own_writer_key_and_sub_key_only() -> None:
    secret = RunSecret.generate()
    key, sub = f"{RUN}/abc/progress", MEMBER.peer_id
    stored = secret.encrypt(MEMBER.peer_id, key, sub, b'{"epoch": 3}')
    assert stored.startswith(MAGIC) and len(stored) == len(b'{"epoch": 3}') + RECORD_OVERHEAD
    assert b"epoch" not in stored
    assert RunSecret(secret.secret).decrypt(MEMBER.peer_id, key, sub, stored) == b'{"epoch": 3}'
    assert secret.encrypt(MEMBER.peer_id, key, sub, b'{"epoch": 3}') != stored  # fresh nonce
    for writer, moved_key, moved_sub in ((MEMBER.peer_id, f"{RUN}/abc/manifests", sub),
                                         (MEMBER.peer_id, f"averaging/{RUN}/abc/progress", sub),
                                         (MEMBER.peer_id, key, OTHER.peer_id),
                                         (MEMBER.peer_id, key, None),
                                         (OTHER.peer_id, key, sub)):
        with pytest.raises(RecordUnreadable, match="does not authenticate"):
            secret.decrypt(writer, moved_key, moved_sub, stored)
    for index in range(len(MAGIC) + 4, len(stored), 7):  # the nonce, ciphertext and tag
        altered = bytearray(stored)
        altered[index] ^= 0x80
        with pytest.raises(RecordUnreadable):
            secret.decrypt(MEMBER.peer_id, key, sub, bytes(altered))
    with pytest.raises(RecordUnreadable, match="another key"):
        RunSecret.generate().decrypt(MEMBER.peer_id, key, sub, stored)
    for clear in (b'{"epoch": 3}', b"", stored[:RECORD_OVERHEAD - 1]):
        with pytest.raises(RecordUnreadable, match="not an encrypted record"):
            secret.decrypt(MEMBER.peer_id, key, sub, clear)
    assert secret.secret.hex() not in repr(secret)


# --- tokens ----------------------------------------------------------------------------------


def test_a_tokens_run_key_opens_for_its_peer_only() -> None:
    secret = RunSecret.generate()
    token = MembershipToken.decode(
        MembershipToken.issue(OWNER, "club", MEMBER.peer_id, "trainer", 60.0, secret).encode())
    assert token.run_secret(MEMBER).secret == secret.secret
    assert secret.secret not in token.key and secret.secret.hex() not in token.encode()
    with pytest.raises(MembershipError, match="does not open with this node's identity"):
        token.run_secret(OTHER)
    # Someone who holds the token cannot hold it as their own, nor swap the sealed key for
    # one of their making: the owner signed the one in it.
    with pytest.raises(MembershipError, match="not for this node"):
        MembershipRegistry(OTHER).hold(token)
    swapped = dataclasses.replace(token, key=seal(MEMBER.peer_id, os.urandom(32), b"x"))
    with pytest.raises(MembershipError, match="not signed by the run's owner"):
        MembershipToken.decode(swapped.encode())


def test_a_token_sealed_to_another_peer_is_refused_when_held() -> None:
    # The owner's own mistake (or a forged key it signed): the member is told, not crashed.
    good = MembershipToken.issue(OWNER, "club", OTHER.peer_id, "trainer", 60.0,
                                 RunSecret.generate())
    wrong = dataclasses.replace(good, peer=MEMBER.peer_id, signature=b"")
    wrong = dataclasses.replace(wrong, signature=OWNER.sign(wrong.signing_bytes()))
    registry = MembershipRegistry(MEMBER)
    with pytest.raises(MembershipError, match="ask the run's owner for a new token"):
        registry.hold(MembershipToken.decode(wrong.encode()))
    assert registry.held(OWNER.peer_id, "club") is None


def test_older_tokens_are_refused_with_what_to_do() -> None:
    claims = {"owner": OWNER.peer_id, "run": "club", "peer": MEMBER.peer_id, "role": "trainer",
              "issued": time.time(), "expires": time.time() + 60, "serial": "00" * 8}
    body = base64.urlsafe_b64encode(orjson.dumps(claims)).rstrip(b"=").decode()
    with pytest.raises(MembershipError, match=r"older dedloc.*issue you a new one"):
        MembershipToken.decode(f"dlt1.{body}.AAAA")
    # the same fields under the new prefix: a field is missing
    with pytest.raises(MembershipError, match="fields are wrong"):
        MembershipToken.decode(f"dlt2.{body}.AAAA")


# --- the registry: what a member stores and reads ---------------------------------------------


def _member() -> tuple[MembershipRegistry, RunSecret]:
    secret = RunSecret.generate()
    registry = MembershipRegistry(MEMBER)
    registry.hold(MembershipToken.issue(OWNER, "club", MEMBER.peer_id, "trainer", 600.0, secret))
    return registry, secret


def _entry(writer: Identity, key: str, value: bytes, sub_key: str | None = None) -> Entry:
    return Entry.create(writer, key, value, time.time() + 60, sub_key)


def test_members_encrypt_every_key_of_the_run_but_the_revocation_list() -> None:
    registry, secret = _member()
    for key in (f"{RUN}/manifests", f"{RUN}/abc/progress", f"{RUN}/abc/roster/epoch-3",
                f"averaging/{RUN}/abc/epoch-3"):
        stored = registry.conceal(key, MEMBER.peer_id, b'{"samples": 1}')
        assert stored.startswith(MAGIC) and b"samples" not in stored
        entry = _entry(MEMBER, key, stored, MEMBER.peer_id)
        assert registry.reveal(entry) == b'{"samples": 1}'
        assert secret.decrypt(MEMBER.peer_id, key, MEMBER.peer_id, stored) == b'{"samples": 1}'
    for key in ("collab/club/abc/progress", "peer/x", revocations_key(OWNER.peer_id, "club")):
        assert registry.conceal(key, None, b"clear") == b"clear"
        entry = _entry(MEMBER, key, b"clear")
        assert registry.reveal(entry) is entry.value
    # The owner encrypts with the secret of its ledger, which the members' tokens carry.
    owner = MembershipRegistry(OWNER)
    owner.keep_secret("club", secret)
    stored = owner.conceal(f"{RUN}/manifests", OWNER.peer_id, b"manifest")
    assert registry.reveal(_entry(OWNER, f"{RUN}/manifests", stored, OWNER.peer_id)) == b"manifest"


def test_a_node_without_the_run_key_writes_nothing_and_reads_nothing() -> None:
    registry, _ = _member()
    stored = registry.conceal(f"{RUN}/abc/progress", MEMBER.peer_id, b"report")
    stranger = MembershipRegistry(OTHER)
    with pytest.raises(NotAMember, match=r"holds no key of closed run 'club'.*join the run"):
        stranger.conceal(f"{RUN}/abc/progress", OTHER.peer_id, b"report")
    assert stranger.reveal(_entry(MEMBER, f"{RUN}/abc/progress", stored, MEMBER.peer_id)) is None
    assert not stranger.refusals_by_reason  # (not the writer's fault)


def test_records_that_do_not_open_are_dropped_and_counted_against_their_writer() -> None:
    registry, _ = _member()
    writer = Identity.generate()
    progress = f"{RUN}/abc/progress"
    honest = registry.conceal(progress, MEMBER.peer_id, b"report")
    # in clear; with another key; moved (a member re-signs another's ciphertext as its own, or
    # under another key)
    other_key = MembershipRegistry(writer)
    other_key.hold(MembershipToken.issue(OWNER, "club", writer.peer_id, "trainer", 600.0,
                                         RunSecret.generate()))
    for entry in (_entry(writer, progress, b'{"epoch": 1}', writer.peer_id),
                  _entry(writer, progress, other_key.conceal(progress, writer.peer_id, b"r"),
                         writer.peer_id),
                  _entry(writer, progress, honest, writer.peer_id),
                  _entry(writer, f"{RUN}/abc/manifests", honest, writer.peer_id)):
        assert registry.reveal(entry) is None
    assert registry.refusals_by_reason["unreadable_record"] == 4
    assert dict(registry.refusals) == {writer.peer_id: 4}
    assert registry.stats()["refusals_by_reason"] == {"unreadable_record": 4}


# --- the owner's ledger keeps the run's secret -------------------------------------------------


def test_the_owners_secret_survives_a_restart_in_a_private_file(tmp_path: Path) -> None:
    told: list[tuple[str, int, bytes]] = []

    def listener(run: str, generation: int, secrets: list[RunSecret], grace: float,
                 rekeyed: float | None) -> None:
        told.append((run, generation, secrets[0].secret))

    owned = OwnedRuns(OWNER, tmp_path / "owned", on_keys=listener)
    secret = owned.ledger("club").secret
    path = tmp_path / "owned" / "club.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # written before any token is issued
    token = owned.issue("club", MEMBER.peer_id, "trainer", 1.0)
    assert token.run_secret(MEMBER).secret == secret.secret
    assert told == [("club", 0, secret.secret)]
    again = OwnedRuns(OWNER, tmp_path / "owned", on_keys=listener)
    assert again.ledger("club").secret.secret == secret.secret
    assert told[-1] == ("club", 0, secret.secret)
    assert again.issue("club", OTHER.peer_id, "aux", 1.0).run_secret(OTHER).secret == secret.secret


def test_a_ledger_from_before_run_secrets_gets_one_and_keeps_it(tmp_path: Path) -> None:
    directory = tmp_path / "owned"
    directory.mkdir()
    (directory / "club.json").write_bytes(orjson.dumps(
        {"run": "club", "owner": OWNER.peer_id, "issued": [], "revoked_serials": [],
         "revoked_peers": [], "version": 0.0}))
    first = OwnedRuns(OWNER, directory).ledger("club").secret.secret
    assert OwnedRuns(OWNER, directory).ledger("club").secret.secret == first
    (directory / "bad.json").write_bytes(orjson.dumps(
        {"run": "bad", "owner": OWNER.peer_id, "secret": "not base64!"}))
    owned = OwnedRuns(OWNER, directory)
    assert owned.names() == ["club"]  # (logged, skipped)
    # and never replaced by a ledger with a new secret: members holding tokens of the old one
    # and of a new one would read none of each other's records (two runs in one)
    before = (directory / "bad.json").read_bytes()
    with pytest.raises(MembershipError, match="could not be read: restore it"):
        owned.ledger("bad")
    with pytest.raises(MembershipError, match="could not be read"):
        owned.issue("bad", MEMBER.peer_id, "trainer", 1.0)
    assert (directory / "bad.json").read_bytes() == before


def test_the_owned_directory_is_made_private_even_when_it_exists(tmp_path: Path) -> None:
    directory = tmp_path / "owned"
    directory.mkdir(mode=0o755)
    OwnedRuns(OWNER, directory).ledger("club")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
