"""The owner's side of a closed run: the tokens it issued and the ones it revoked, kept on disk.

A daemon owns the closed runs it creates (its identity signs their manifests and tokens). Its
ledger of each run, `<state_dir>/owned/<run>.json`, lists every token issued (serial, peer, role,
expiry) and what was revoked, so that `dedloc token list` can show them and `dedloc token revoke`
survives restarts. The revocation list is published in the DHT under the run's `revoked` key (the
owner's peer id as sub-key: nobody else may write it) whenever it changes, when the daemon starts
and then every `REPUBLISH_EVERY` seconds, with a long expiry so that it outlives short absences.

The ledger also keeps the run's secret (secrecy.py), drawn when the ledger is made (the run's
creation, or the first token issued) and never changed: every token carries it sealed to its
peer, and the owner's daemon encrypts its own records with it after a restart as before. The
file is written with mode 0600 in a 0700 directory.
"""

from __future__ import annotations

import base64
import binascii
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
from .membership import MembershipError, MembershipToken, Revocations, revocations_key
from .secrecy import RUN_SECRET_BYTES, RunSecret

if TYPE_CHECKING:
    from ..dht import DHTNode

log = structlog.get_logger(__name__)

REVOCATIONS_TTL = 3 * 24 * 3600.0
REPUBLISH_EVERY = 6 * 3600.0
MAX_TOKEN_DAYS = 3650.0


@dataclass
class RunLedger:
    """What the owner issued and revoked for one closed run."""

    run: str
    owner: str
    secret: RunSecret = field(default_factory=RunSecret.generate, repr=False)
    issued: list[dict[str, Any]] = field(default_factory=list)
    revoked_serials: set[str] = field(default_factory=set)
    revoked_peers: set[str] = field(default_factory=set)
    version: float = 0.0

    def revocations(self) -> Revocations:
        return Revocations(self.owner, self.run, self.version, frozenset(self.revoked_serials),
                           frozenset(self.revoked_peers))

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "owner": self.owner,
                "secret": base64.b64encode(self.secret.secret).decode(), "issued": self.issued,
                "revoked_serials": sorted(self.revoked_serials),
                "revoked_peers": sorted(self.revoked_peers), "version": self.version}

    @classmethod
    def from_json(cls, data: Any) -> tuple[RunLedger, bool]:
        """The ledger, and whether its secret is new (a ledger written before runs had one)."""
        text = data.get("secret")
        if text is None:
            secret, fresh = RunSecret.generate(), True
        else:
            raw = base64.b64decode(str(text), validate=True)
            if len(raw) != RUN_SECRET_BYTES:
                raise ValueError(f"the run's secret is {len(raw)} bytes, not {RUN_SECRET_BYTES}")
            secret, fresh = RunSecret(raw), False
        ledger = cls(str(data["run"]), str(data["owner"]), secret, list(data.get("issued", [])),
                     set(data.get("revoked_serials", [])), set(data.get("revoked_peers", [])),
                     float(data.get("version", 0.0)))
        return ledger, fresh


class OwnedRuns:
    """The ledgers of the closed runs this daemon owns."""

    def __init__(self, identity: Identity, directory: Path,
                 on_secret: Callable[[str, RunSecret], None] | None = None) -> None:
        """`on_secret(run, secret)` is told each owned run's secret (loaded or new)."""
        self.identity = identity
        self.directory = directory
        self._on_secret = on_secret
        self._ledgers: dict[str, RunLedger] = {}
        self._unreadable: set[str] = set()  # runs whose ledger file could not be read
        self._load()

    def _keep(self, ledger: RunLedger) -> None:
        self._ledgers[ledger.run] = ledger
        if self._on_secret is not None:
            self._on_secret(ledger.run, ledger.secret)

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
        token = MembershipToken.issue(self.identity, run, peer, role, days * 86400.0, ledger.secret)
        ledger.issued.append({"serial": token.serial, "peer": peer, "role": role,
                              "issued": token.issued, "expires": token.expires})
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
        if serial is not None:
            if serial not in {item["serial"] for item in ledger.issued}:
                raise MembershipError(f"no token of run {run!r} has serial {serial!r} "
                                      "(see dedloc token list)")
            ledger.revoked_serials.add(serial)
        if peer is not None:
            ledger.revoked_peers.add(peer)
        ledger.version = max(timebase.now(), ledger.version + 1e-3)  # strictly newer than the last
        self._save(ledger)
        log.info("token_revoked", run=run, serial=serial, peer=None if peer is None else peer[:16])
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
        """Store run's revocation list in the DHT (nothing to do if nothing was revoked)."""
        ledger = self._ledgers.get(run)
        if ledger is None or ledger.version == 0.0:
            return True
        try:
            stored = await dht.store(revocations_key(ledger.owner, run), ledger.revocations().to_bytes(),
                                     timebase.now() + REVOCATIONS_TTL, sub_key=ledger.owner, timeout=10.0)
        except (TransportError, TimeoutError) as exc:
            log.warning("revocations_publish_failed", run=run, error=str(exc))
            return False
        return stored > 0
