"""The owner's side of a closed run: the tokens it issued and the ones it revoked, kept on disk.

A daemon owns the closed runs it creates (its identity signs their manifests and tokens). Its
ledger of each run, `<state_dir>/owned/<run>.json`, lists every token issued (serial, peer, role,
expiry) and what was revoked, so that `dedloc token list` can show them and `dedloc token revoke`
survives restarts. The revocation list is published in the DHT under the run's `revoked` key (the
owner's peer id as sub-key: nobody else may write it) whenever it changes, when the daemon starts
and then every `REPUBLISH_EVERY` seconds, with a long expiry so that it outlives short absences.

The ledger also keeps the run's secret (secrecy.py), drawn when the ledger is made (the run's
creation, or the first token issued): every token carries it sealed to its peer, and the
owner's daemon encrypts its own records with it after a restart as before. Every revocation
draws a new generation of it (the ledger keeps the newest `KEPT_GENERATIONS`): tokens issued
from then on carry the new one, and the members that held a token when it was drawn learn it
from the owner's re-keying records (rekeying.py), published with the revocation list, so that a
revoked member reads none of the records written with it. The file is written with mode 0600 in
a 0700 directory.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from .. import timebase
from ..identity import Identity
from ..net import TransportError
from .membership import (
    MAX_REKEY_CHUNKS,
    MembershipError,
    MembershipToken,
    Revocations,
    revocations_key,
)
from .rekeying import MAX_REKEYED_PEERS, REKEY_GRACE, RekeyError, plan_chunks, publish_rekeying
from .secrecy import KEPT_GENERATIONS, MAX_GENERATION, RUN_SECRET_BYTES, RunSecret

if TYPE_CHECKING:
    from ..dht import DHTNode

log = structlog.get_logger(__name__)

#: told (run, generation, secrets newest first, grace) of each owned run's secret
KeysListener = Callable[[str, int, list[RunSecret], float], None]

REVOCATIONS_TTL = 3 * 24 * 3600.0
REPUBLISH_EVERY = 6 * 3600.0
MAX_TOKEN_DAYS = 3650.0


def _secret_of(text: Any) -> RunSecret:
    raw = base64.b64decode(str(text), validate=True)
    if len(raw) != RUN_SECRET_BYTES:
        raise ValueError(f"the run's secret is {len(raw)} bytes, not {RUN_SECRET_BYTES}")
    return RunSecret(raw)


def _first_secrets() -> dict[int, RunSecret]:
    return {0: RunSecret.generate()}


@dataclass
class RunLedger:
    """What the owner issued and revoked for one closed run, and its secret's generations."""

    run: str
    owner: str
    secrets: dict[int, RunSecret] = field(default_factory=_first_secrets, repr=False)
    issued: list[dict[str, Any]] = field(default_factory=list)
    revoked_serials: set[str] = field(default_factory=set)
    revoked_peers: set[str] = field(default_factory=set)
    version: float = 0.0
    generation: int = 0  # the secret's current one (one more each revocation)
    chunks: int = 0  # the current generation's re-keying records (rekeying.py)
    rotated: float = 0.0  # when it was drawn: tokens issued later carry it

    @property
    def secret(self) -> RunSecret:
        return self.secrets[self.generation]

    def newest_first(self) -> list[RunSecret]:
        """The secrets of the current generation and of those before it that are kept."""
        return [self.secrets[g] for g in sorted(self.secrets, reverse=True)]

    def members(self, now: float, issued_by: float = math.inf,
                revoked: tuple[set[str], set[str]] | None = None) -> list[str]:
        """The peers holding an unexpired, unrevoked token (issued by `issued_by`; `revoked`:
        serials and peers, the ledger's unless given)."""
        serials, peers = revoked or (self.revoked_serials, self.revoked_peers)
        return sorted({item["peer"] for item in self.issued
                       if item["expires"] > now and item["issued"] <= issued_by
                       and item["serial"] not in serials and item["peer"] not in peers})

    def issue(self, identity: Identity, peer: str, role: str, seconds: float) -> MembershipToken:
        now = timebase.now()
        if len({*self.members(now), peer}) > MAX_REKEYED_PEERS:
            raise RekeyError(f"closed run {self.run!r} has {MAX_REKEYED_PEERS} member peers, as "
                             "many as a revocation can re-key: revoke the tokens of peers that "
                             "no longer take part (dedloc token revoke), wait for some to "
                             "expire, or start another run")
        secrets = self.newest_first()
        token = MembershipToken.issue(identity, self.run, peer, role, seconds, secrets[0],
                                      generation=self.generation, earlier=secrets[1:])
        self.issued.append({"serial": token.serial, "peer": peer, "role": role,
                            "issued": token.issued, "expires": token.expires})
        return token

    def revoke(self, serial: str | None, peer: str | None) -> None:
        """Revoke, and draw the secret's next generation (nothing changes on an error)."""
        serials = self.revoked_serials | ({serial} if serial is not None else set())
        peers = self.revoked_peers | ({peer} if peer is not None else set())
        if self.generation >= MAX_GENERATION:
            raise MembershipError(f"closed run {self.run!r} was re-keyed {MAX_GENERATION} times; "
                                  "start another run")
        now = timebase.now()
        chunks = plan_chunks(self.members(now, revoked=(serials, peers)))
        self.revoked_serials, self.revoked_peers = serials, peers
        self.generation += 1
        self.secrets[self.generation] = RunSecret.generate()
        for old in sorted(self.secrets)[:-KEPT_GENERATIONS]:
            del self.secrets[old]
        self.chunks, self.rotated = chunks, now
        self.version = max(now, self.version + 1e-3)  # strictly newer than the last

    def revocations(self) -> Revocations:
        return Revocations(self.owner, self.run, self.version, frozenset(self.revoked_serials),
                           frozenset(self.revoked_peers), self.generation, self.chunks)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "owner": self.owner,
                "secret": base64.b64encode(self.secret.secret).decode(),
                "generation": self.generation, "chunks": self.chunks, "rotated": self.rotated,
                "earlier": {str(g): base64.b64encode(s.secret).decode()
                            for g, s in self.secrets.items() if g != self.generation},
                "issued": self.issued, "revoked_serials": sorted(self.revoked_serials),
                "revoked_peers": sorted(self.revoked_peers), "version": self.version}

    @classmethod
    def from_json(cls, data: Any) -> tuple[RunLedger, bool]:
        """The ledger, and whether its secret is new (a ledger written before runs had one)."""
        text = data.get("secret")
        generation, chunks = data.get("generation", 0), data.get("chunks", 0)
        if type(generation) is not int or not 0 <= generation <= MAX_GENERATION or type(
                chunks) is not int or not 0 <= chunks <= MAX_REKEY_CHUNKS:
            raise ValueError(f"generation {generation!r} or re-keying records {chunks!r} out of "
                             "bounds")
        fresh = text is None
        secrets = {generation: RunSecret.generate() if fresh else _secret_of(text)}
        for key, value in dict(data.get("earlier", {})).items():
            if not 0 <= int(key) < generation:
                raise ValueError(f"an earlier generation {key!r} of the secret is not before "
                                 f"{generation}")
            secrets[int(key)] = _secret_of(value)
        if len(secrets) > KEPT_GENERATIONS or set(secrets) != set(
                range(generation + 1 - len(secrets), generation + 1)):
            raise ValueError(f"generations {sorted(secrets)} of the secret are not the newest "
                             f"ones in a row (at most {KEPT_GENERATIONS})")
        ledger = cls(str(data["run"]), str(data["owner"]), secrets, list(data.get("issued", [])),
                     set(data.get("revoked_serials", [])), set(data.get("revoked_peers", [])),
                     float(data.get("version", 0.0)), generation, chunks,
                     float(data.get("rotated", 0.0)))
        return ledger, fresh


class OwnedRuns:
    """The ledgers of the closed runs this daemon owns."""

    def __init__(self, identity: Identity, directory: Path,
                 on_keys: KeysListener | None = None) -> None:
        """`on_keys(run, generation, secrets, grace)` is told each owned run's secret (loaded,
        new, or a new generation of it: to be written with `grace` seconds later), with the
        earlier generations kept, newest first (MembershipRegistry.keep_keys)."""
        self.identity = identity
        self.directory = directory
        self._on_keys = on_keys
        self._ledgers: dict[str, RunLedger] = {}
        self._unreadable: set[str] = set()  # runs whose ledger file could not be read
        self._load()

    def _keep(self, ledger: RunLedger, grace: float = 0.0) -> None:
        self._ledgers[ledger.run] = ledger
        if self._on_keys is not None:
            self._on_keys(ledger.run, ledger.generation, ledger.newest_first(), grace)

    def _path(self, run: str) -> Path:
        return self.directory / f"{run}.json"

    def _load(self) -> None:
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.glob("*.json")):
            try:
                ledger, fresh = RunLedger.from_json(orjson.loads(path.read_bytes()))
            except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError,
                    binascii.Error) as exc:
                log.error("owned_run_ledger_unreadable", path=str(path), error=str(exc),
                          hint="its run's secret and tokens are in it: restore it from a backup "
                               "(it is not replaced while it stays unreadable)")
                self._unreadable.add(path.stem)
                continue
            if ledger.owner != self.identity.peer_id:
                continue
            if fresh:  # (its tokens, of the older format, are refused anyway: issue new ones)
                self._save(ledger)
                log.warning("owned_run_secret_created", run=ledger.run,
                            hint="tokens issued before this version are refused; issue new ones "
                                 "(dedloc token issue)")
            self._keep(ledger)

    def _save(self, ledger: RunLedger) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)  # (mkdir's mode is not applied to one that exists)
        path = self._path(ledger.run)
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # (a leftover would keep its mode)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o600)  # (it holds the secret)
        with os.fdopen(fd, "wb") as handle:
            handle.write(orjson.dumps(ledger.to_json(), option=orjson.OPT_INDENT_2))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    def ledger(self, run: str) -> RunLedger:
        """Run's ledger; a new one (with a new secret, saved at once) if it had none."""
        ledger = self._ledgers.get(run)
        if ledger is None:
            if run in self._unreadable:  # a new secret would split the run's members in two
                raise MembershipError(
                    f"this node's ledger of closed run {run!r} ({self._path(run)}) could not be "
                    "read: restore it (it holds the run's secret and tokens), or move it away "
                    "and restart to start the run afresh (every member then needs a new token)")
            ledger = RunLedger(run, self.identity.peer_id)
            self._save(ledger)  # (the secret must outlive a restart: members hold it)
            self._keep(ledger)
        return ledger

    def names(self) -> list[str]:
        return sorted(self._ledgers)

    def issue(self, run: str, peer: str, role: str, days: float) -> MembershipToken:
        if not 0 < days <= MAX_TOKEN_DAYS:
            raise MembershipError(f"days must be in (0, {MAX_TOKEN_DAYS:.0f}], not {days}")
        ledger = self.ledger(run)
        token = ledger.issue(self.identity, peer, role, days * 86400.0)
        self._save(ledger)
        log.info("token_issued", run=run, peer=peer[:16], role=role, serial=token.serial,
                 expires=token.expires)
        return token

    def revoke(self, run: str, serial: str | None, peer: str | None) -> Revocations:
        if run not in self._ledgers:
            raise MembershipError(f"this node has issued no token of run {run!r}")
        if serial is None and peer is None:
            raise MembershipError("name a token serial or a peer id to revoke")
        ledger = self._ledgers[run]
        if serial is not None and serial not in {item["serial"] for item in ledger.issued}:
            raise MembershipError(f"no token of run {run!r} has serial {serial!r} "
                                  "(see dedloc token list)")
        ledger.revoke(serial, peer)
        self._save(ledger)
        self._keep(ledger, grace=REKEY_GRACE)  # (the members learn it first)
        log.info("token_revoked", run=run, serial=serial, peer=None if peer is None else peer[:16],
                 generation=ledger.generation, rekeyed=len(ledger.members(
                     timebase.now(), ledger.rotated)))
        return ledger.revocations()

    def listing(self, run: str) -> dict[str, Any]:
        ledger = self._ledgers.get(run)
        if ledger is None:
            return {"run": run, "owner": self.identity.peer_id, "tokens": [], "revoked_peers": []}
        now = timebase.now()
        tokens = [{**item, "revoked": item["serial"] in ledger.revoked_serials
                   or item["peer"] in ledger.revoked_peers, "expired": item["expires"] <= now}
                  for item in ledger.issued]
        return {"run": run, "owner": ledger.owner, "tokens": tokens,
                "revoked_peers": sorted(ledger.revoked_peers)}

    async def publish(self, dht: DHTNode, run: str) -> bool:
        """Store run's revocation list and re-keying records in the DHT (`publish_ledger`)."""
        ledger = self._ledgers.get(run)
        return True if ledger is None else await publish_ledger(dht, ledger)


async def publish_ledger(dht: DHTNode, ledger: RunLedger) -> bool:
    """Store a run's re-keying records, then its revocation list (so that a member that reads
    the list finds them), under the owner's sub-key; nothing to do if nothing was revoked.
    True if all were stored."""
    if ledger.version == 0.0:
        return True
    run, owner = ledger.run, ledger.owner
    now = timebase.now()
    rekeyed = ledger.generation == 0 or await publish_rekeying(
        dht, owner, run, ledger.generation, ledger.newest_first(),
        ledger.members(now, ledger.rotated), ledger.chunks, now + REVOCATIONS_TTL)
    try:
        stored = await dht.store(revocations_key(owner, run), ledger.revocations().to_bytes(),
                                 now + REVOCATIONS_TTL, sub_key=owner, timeout=10.0)
    except (TransportError, TimeoutError) as exc:
        log.warning("revocations_publish_failed", run=run, error=str(exc))
        return False
    return stored > 0 and rekeyed
