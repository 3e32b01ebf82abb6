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
revoked member reads none of the records written with it; the owner writes with it
`REKEY_GRACE` after those records were first stored (a failed publish is tried again after
`RETRY_FIRST` s, doubling up to `RETRY_MOST`). Each token's entry names its generation (the
members to re-key are those of earlier ones). A change is used only once the ledger was saved,
so a generation is never drawn twice by a failed save; a ledger found behind the list the DHT
holds (restored from a backup) re-keys above it. The file is written with mode 0600 in a 0700
directory.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from .. import timebase
from ..identity import Identity
from ..net import TransportError
from .errors import MembershipError
from .membership import revocations_key
from .rekeying import MAX_REKEYED_PEERS, REKEY_GRACE, RekeyError, plan_chunks, publish_rekeying
from .revocations import MAX_REKEY_CHUNKS, Revocations
from .secrecy import KEPT_GENERATIONS, MAX_GENERATION, RUN_SECRET_BYTES, RunSecret
from .tokens import MembershipToken

if TYPE_CHECKING:
    from ..dht import DHTNode

log = structlog.get_logger(__name__)

#: told (run, generation, secrets newest first, grace, rekeyed) of each owned run's secret
KeysListener = Callable[[str, int, list[RunSecret], float, float | None], None]

REVOCATIONS_TTL = 3 * 24 * 3600.0
REPUBLISH_EVERY = 6 * 3600.0
RETRY_FIRST = 5.0  # a failed publish is tried again after this, doubling
RETRY_MOST = 300.0  # up to this
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
    rekeyed: float = 0.0  # when its re-keying records were first all stored (0: not yet)

    @property
    def secret(self) -> RunSecret:
        return self.secrets[self.generation]

    def newest_first(self) -> list[RunSecret]:
        """The secrets of the current generation and of those before it that are kept."""
        return [self.secrets[g] for g in sorted(self.secrets, reverse=True)]

    def members(self, now: float, before: int | None = None,
                revoked: tuple[set[str], set[str]] | None = None) -> list[str]:
        """The peers holding an unexpired, unrevoked token (of a generation before `before`:
        those that need its re-keying records; `revoked`: serials and peers, the ledger's
        unless given). Tokens listed without a generation are of generation 0."""
        serials, peers = revoked or (self.revoked_serials, self.revoked_peers)
        return sorted({item["peer"] for item in self.issued
                       if item["expires"] > now and (before is None
                                                     or item.get("generation", 0) < before)
                       and item["serial"] not in serials and item["peer"] not in peers})

    def copy(self) -> RunLedger:
        """A copy to change (the ledger in use changes only once the copy was saved)."""
        return dataclasses.replace(self, secrets=dict(self.secrets), issued=list(self.issued),
                                   revoked_serials=set(self.revoked_serials),
                                   revoked_peers=set(self.revoked_peers))

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
                            "issued": token.issued, "expires": token.expires,
                            "generation": self.generation})
        return token

    def revoke(self, serial: str | None, peer: str | None) -> RekeyError | None:
        """Revoke, and draw the secret's next generation (nothing changes on an error). If the
        members are too many to re-key (a ledger from before the cap), the revocation is
        recorded all the same, with no new generation: that error is returned."""
        serials = self.revoked_serials | ({serial} if serial is not None else set())
        peers = self.revoked_peers | ({peer} if peer is not None else set())
        now = timebase.now()
        try:
            self.rotate(now, self.generation, revoked=(serials, peers))
        except RekeyError as exc:
            problem: RekeyError | None = exc
        else:
            problem = None
        self.revoked_serials, self.revoked_peers = serials, peers
        self.version = max(now, self.version + 1e-3)  # strictly newer than the last
        return problem

    def rotate(self, now: float, after: int,
               revoked: tuple[set[str], set[str]] | None = None) -> None:
        """Draw generation `after + 1` of the secret for the members (less `revoked`);
        MembershipError (nothing changes) if it cannot be."""
        if after >= MAX_GENERATION:
            raise MembershipError(f"closed run {self.run!r} was re-keyed {MAX_GENERATION} times; "
                                  "start another run")
        chunks = plan_chunks(self.members(now, revoked=revoked))
        if after != self.generation:  # (skipping numbers: the ones kept must be consecutive)
            self.secrets.clear()
        self.generation = after + 1
        self.secrets[self.generation] = RunSecret.generate()
        for old in sorted(self.secrets)[:-KEPT_GENERATIONS]:
            del self.secrets[old]
        self.chunks, self.rotated, self.rekeyed = chunks, now, 0.0

    def behind(self, published: Revocations) -> bool:
        """Is `published` (this run's list as the DHT holds it) newer than this ledger, or does
        it name a generation this ledger did not draw (restored from a backup)?"""
        return published.version > self.version or published.generation > self.generation or (
            published.generation == self.generation and bool(published.key_id)
            and published.key_id != self.secret.key_id.hex())

    def catch_up(self, published: Revocations, now: float) -> None:
        """After `behind`: re-key above the published generation (members hold it, or a number
        drawn twice: this ledger's would split them) and list it as newer."""
        if published.generation > self.generation or (
                published.generation == self.generation and bool(published.key_id)
                and published.key_id != self.secret.key_id.hex()):
            self.rotate(now, published.generation)
        elif published.generation == self.generation and published.rekeyed and not self.rekeyed:
            self.rekeyed = published.rekeyed  # (noted when it was stored, then not saved)
        self.version = max(now, self.version + 1e-3, published.version + 1e-3)

    def revocations(self) -> Revocations:
        return Revocations(self.owner, self.run, self.version, frozenset(self.revoked_serials),
                           frozenset(self.revoked_peers), self.generation, self.chunks,
                           self.secret.key_id.hex() if self.generation else "",
                           self.rekeyed or None if self.generation else None)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "owner": self.owner,
                "secret": base64.b64encode(self.secret.secret).decode(),
                "generation": self.generation, "chunks": self.chunks, "rotated": self.rotated,
                "rekeyed": self.rekeyed,
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
                     float(data.get("rotated", 0.0)), float(data.get("rekeyed", 0.0)))
        return ledger, fresh


class OwnedRuns:
    """The ledgers of the closed runs this daemon owns."""

    def __init__(self, identity: Identity, directory: Path,
                 on_keys: KeysListener | None = None) -> None:
        """`on_keys(run, generation, secrets, grace, rekeyed)` is told each owned run's secret
        (loaded, new, or a new generation of it), with the earlier generations kept, newest
        first (MembershipRegistry.keep_keys): a new generation is written with `grace` after
        its re-keying records were first stored (`rekeyed`), never before (grace: infinite)."""
        self.identity = identity
        self.directory = directory
        self._on_keys = on_keys
        self._ledgers: dict[str, RunLedger] = {}
        self._unreadable: set[str] = set()  # runs whose ledger file could not be read
        # why the last revocation of a run could not re-key it (None: it did)
        self.rekey_errors: dict[str, str | None] = {}
        self._load()

    def _keep(self, ledger: RunLedger) -> None:
        self._ledgers[ledger.run] = ledger
        if self._on_keys is None:
            return
        if ledger.generation == 0:
            self._on_keys(ledger.run, 0, ledger.newest_first(), 0.0, None)
        elif ledger.rekeyed:  # (the members learn it from its records first)
            self._on_keys(ledger.run, ledger.generation, ledger.newest_first(), REKEY_GRACE,
                          ledger.rekeyed)
        else:  # (its records were never stored: nobody could learn it yet)
            self._on_keys(ledger.run, ledger.generation, ledger.newest_first(), math.inf, None)

    def _replace(self, ledger: RunLedger, keys: bool = True) -> None:
        """Save a changed copy of a ledger and use it from then on (OSError: nothing changed);
        `keys`: its secrets changed (told to on_keys)."""
        self._save(ledger)
        if keys:
            self._keep(ledger)
        else:
            self._ledgers[ledger.run] = ledger

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
        ledger = self.ledger(run).copy()
        token = ledger.issue(self.identity, peer, role, days * 86400.0)
        self._replace(ledger, keys=False)
        log.info("token_issued", run=run, peer=peer[:16], role=role, serial=token.serial,
                 expires=token.expires)
        return token

    def revoke(self, run: str, serial: str | None, peer: str | None) -> Revocations:
        if run not in self._ledgers:
            raise MembershipError(f"this node has issued no token of run {run!r}")
        if serial is None and peer is None:
            raise MembershipError("name a token serial or a peer id to revoke")
        ledger = self._ledgers[run].copy()
        if serial is not None and serial not in {item["serial"] for item in ledger.issued}:
            raise MembershipError(f"no token of run {run!r} has serial {serial!r} "
                                  "(see dedloc token list)")
        problem = ledger.revoke(serial, peer)
        self._replace(ledger)  # (a save that fails changes nothing: no generation drawn twice)
        if problem is not None:
            log.error("token_revoked_without_rekeying", run=run, serial=serial,
                      generation=ledger.generation, error=str(problem),
                      hint="the revocation is published and members refuse the token, but the "
                           "run's secret was not changed: the revoked peer can still read what "
                           "the members write")
        else:
            log.info("token_revoked", run=run, serial=serial,
                     peer=None if peer is None else peer[:16], generation=ledger.generation,
                     rekeyed=len(ledger.members(timebase.now(), ledger.generation)))
        self.rekey_errors[run] = None if problem is None else str(problem)
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
        """Store run's revocation list and re-keying records in the DHT (`publish_ledger`),
        first re-keying above the list the DHT holds if this ledger is behind it (restored
        from a backup); True if all were stored. The owner writes with a new generation only
        from REKEY_GRACE after its records were first stored."""
        ledger = self._ledgers.get(run)
        if ledger is None:
            return True
        published = await _published(dht, ledger)
        if published is not None and ledger.behind(published):
            caught_up = ledger.copy()
            caught_up.catch_up(published, timebase.now())
            log.error("owned_run_ledger_behind", run=run, generation=ledger.generation,
                      published=published.generation, new=caught_up.generation,
                      hint="this ledger is older than the revocation list the run's members "
                           "hold (restored from a backup?): the run is re-keyed above it; "
                           "revocations made since the backup are lost: make them again")
            self._replace(caught_up)
            ledger = caught_up
        rekeyed = ledger.rekeyed
        stored = await publish_ledger(dht, ledger)
        if ledger.rekeyed != rekeyed:  # (its records were stored: the members learn it now)
            try:
                self._save(ledger)
            except OSError as exc:  # (only when it was first stored is lost)
                log.warning("owned_run_ledger_not_saved", run=run, error=str(exc),
                            hint="check the state directory's disk and permissions")
            self._keep(ledger)
        return stored

    async def keep_published(self, dht: Callable[[], Awaitable[DHTNode | None]],
                             wake: asyncio.Event, stopped: Callable[[], bool]) -> None:
        """Publish every owned run's list and records now, then every REPUBLISH_EVERY seconds;
        while the last publish of any failed, again after RETRY_FIRST seconds, doubling up to
        RETRY_MOST. `dht()` waits for the DHT (None: not joined yet, ask again); `wake` set
        publishes at once (after a revocation). Runs until `stopped()`."""
        retry = RETRY_FIRST
        while not stopped():
            node = await dht()
            if node is None:
                continue
            wake.clear()
            failed = [run for run in self.names() if not await self.publish(node, run)]
            if failed:
                log.warning("owned_runs_publish_retry", runs=failed[:8], retry_in=retry)
                wait, retry = retry, min(2 * retry, RETRY_MOST)
            else:
                wait, retry = REPUBLISH_EVERY, RETRY_FIRST
            with contextlib.suppress(TimeoutError):  # (woken early by a revocation)
                async with asyncio.timeout(wait):
                    await wake.wait()


async def _published(dht: DHTNode, ledger: RunLedger) -> Revocations | None:
    """The run's revocation list as the DHT holds it (None: none, or unreachable)."""
    try:
        record = await dht.get(revocations_key(ledger.owner, ledger.run), timeout=10.0)
    except (TransportError, TimeoutError) as exc:
        log.debug("revocations_read_failed", run=ledger.run, error=str(exc))
        return None
    entry = None if record is None or not record.has_sub_keys else record.sub_keys.get(
        ledger.owner)
    if entry is None or entry.signer != ledger.owner:
        return None
    try:
        return Revocations.from_bytes(entry.value, ledger.owner, ledger.run)
    except MembershipError as exc:
        log.warning("revocations_malformed", run=ledger.run, error=str(exc))
        return None


async def publish_ledger(dht: DHTNode, ledger: RunLedger) -> bool:
    """Store a run's re-keying records, then its revocation list (so that a member that reads
    the list finds them), under the owner's sub-key; nothing to do if nothing was revoked.
    True if all were stored. When the records of the current generation are first all stored,
    the ledger notes when (`rekeyed`, in the list from then on: the members' grace runs from
    it) and lists it as newer."""
    if ledger.version == 0.0:
        return True
    run, owner = ledger.run, ledger.owner
    now = timebase.now()
    rekeyed = ledger.generation == 0 or await publish_rekeying(
        dht, owner, run, ledger.generation, ledger.newest_first(),
        ledger.members(now, ledger.generation), ledger.chunks, now + REVOCATIONS_TTL)
    if rekeyed and ledger.generation and not ledger.rekeyed:
        ledger.rekeyed = now
        ledger.version = max(now, ledger.version + 1e-3)
    try:
        stored = await dht.store(revocations_key(owner, run), ledger.revocations().to_bytes(),
                                 now + REVOCATIONS_TTL, sub_key=owner, timeout=10.0)
    except (TransportError, TimeoutError) as exc:
        log.warning("revocations_publish_failed", run=run, error=str(exc))
        return False
    return stored > 0 and rekeyed
