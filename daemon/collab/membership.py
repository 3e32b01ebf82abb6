"""Membership of closed runs: owner-signed tokens, the owner's revocation list, and the checks.

A **closed** run has an owner: the daemon that created it, whose peer id (an Ed25519 public key)
is in the run's manifest. Only peers holding a token the owner signed may take part:

    MembershipToken(owner, run, peer, role, issued, expires, serial, key) + the owner's signature

A token names the one peer id it is for, so it is useless to anyone else (every peer-to-peer call
is made over a link authenticated by the caller's peer id), and it travels openly: with every DHT
request and record under the run's keys, with matchmaking messages and state requests. Its `key`
is the run's secret (secrecy.py) sealed to that peer id (sealing.py): the secret's current
generation (`generation`, 0 until the owner first revoked a token; the claim is left out then)
and the one before it. Only that peer opens it, when it takes the token
(`MembershipRegistry.hold`), and from then on encrypts what it stores under the run's keys and
decrypts what it reads there (`conceal`, `reveal`), so that the DHT nodes that store the run's
records, members or not, hold only ciphertext. Generations the owner draws later reach the
members through its re-keying records (rekeying.py), not through their tokens.

The run's DHT keys live under `closed/<owner>/<run>/`, so that any DHT node, member or not, knows
from a key alone whose tokens it needs and checks them: a read needs the reader's token; a write
needs its signer's token, which travels with the record (replicas pass it on). The owner's
revocation list is the one record under a closed run's keys that anyone may read and only the
owner may write (`closed/<owner>/<run>/revoked`); members fetch it every `REVOCATIONS_REFRESH`
seconds, and a newer list (by `version`) replaces an older one, never the reverse. It and the
owner's re-keying records (`closed/<owner>/<run>/rekey/<n>`, which members only read: sealed
boxes, one per member) are the records of the run stored in clear, and only the owner writes them.

Open runs keep their keys under `collab/<run>/` and check nothing.

The token itself is tokens.py's, the owner's revocation list revocations.py's; this module keeps
the runs' key layout and the registry that checks them.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from .. import timebase
from ..dht import AccessDenied, Entry
from ..identity import Identity
from .errors import MembershipError
from .revocations import Revocations
from .secrecy import RecordUnreadable, RunKeys, RunSecret
from .tokens import MembershipToken

log = structlog.get_logger(__name__)

CLOSED_PREFIX = "closed/"
NESTING_PREFIXES = ("averaging/",)  # daemon/averaging/matchmaking.py's DHT_PREFIX
OPEN_PREFIX = "collab/"
MAX_REFUSING = 4096  # peers whose refusals are counted one by one (the most recent)
REFUSAL_LOG_EVERY = 60.0  # seconds between two log lines of refusals of one peer
MAX_PEER_ID_CHARS = 128


class NotAMember(MembershipError, AccessDenied):
    """A peer without a valid token asked for something of a closed run."""


def namespace(name: str, owner: str | None) -> str:
    """Where a run's DHT keys live: `collab/<name>` (open) or `closed/<owner>/<name>` (closed)."""
    return f"{CLOSED_PREFIX}{owner}/{name}" if owner else f"{OPEN_PREFIX}{name}"


def closed_run_of(key: str) -> tuple[str, str] | None:
    """(owner, run name) of a key under a closed run's namespace, else None. Keys that another
    layer files under its own prefix (matchmaking's `averaging/`) count as the run's too."""
    for prefix in NESTING_PREFIXES:
        if key.startswith(prefix + CLOSED_PREFIX):
            key = key[len(prefix):]
            break
    if not key.startswith(CLOSED_PREFIX):
        return None
    parts = key.split("/", 3)
    if len(parts) < 3 or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def revocations_key(owner: str, name: str) -> str:
    return f"{namespace(name, owner)}/revoked"


def rekey_key(owner: str, name: str, chunk: int) -> str:
    """Where the owner's re-keying record number `chunk` of a closed run lives (rekeying.py)."""
    return f"{namespace(name, owner)}/rekey/{chunk}"


def _owners_only(key: str, closed: tuple[str, str]) -> bool:
    """Is `key` one that only the run's owner writes, in clear (its list and re-keying)?"""
    return key == revocations_key(*closed) or key.startswith(f"{namespace(closed[1], closed[0])}/rekey/")


class MembershipRegistry:
    """This daemon's side of closed runs: the tokens it holds, the revocation lists it knows, and
    the check every handler of a closed run's traffic calls (refusals counted per peer)."""

    def __init__(self, identity: Identity, clock: Callable[[], float] = timebase.now) -> None:
        self.identity = identity
        self._clock = clock
        self._held: dict[tuple[str, str], MembershipToken] = {}
        # the secrets of the closed runs this peer takes part in (their generations): opened
        # from held tokens and the owner's re-keying records, or its own runs' (ownership.py)
        self._secrets: dict[tuple[str, str], RunKeys] = {}
        self._revocations: dict[tuple[str, str], Revocations] = {}
        self._decoded: collections.OrderedDict[str, MembershipToken | MembershipError] = (
            collections.OrderedDict())
        # by peer id: the most recent MAX_REFUSING peers (ids are free; the count must not grow
        # with them); `refused_peers` counts every peer ever refused
        self.refusals: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.refusals_by_reason: collections.Counter[str] = collections.Counter()
        self.refused_peers = 0
        self._logged: collections.OrderedDict[str, float] = collections.OrderedDict()

    def _refuse(self, peer_id: str, what: str, **context: Any) -> None:
        """Count a refusal of `peer_id` (bounded per peer and in all) and log it, at most once a
        minute per peer (a flood of refusals is one line a minute, not one line each)."""
        peer_id = peer_id[:MAX_PEER_ID_CHARS]
        count = self.refusals.pop(peer_id, None)
        if count is None:
            self.refused_peers += 1
        self.refusals[peer_id] = (count or 0) + 1
        while len(self.refusals) > MAX_REFUSING:
            self.refusals.popitem(last=False)
        self.refusals_by_reason[what] += 1
        now = self._clock()
        last = self._logged.pop(peer_id, None)
        if last is None or now - last >= REFUSAL_LOG_EVERY:
            log.info("membership_refused", peer=peer_id[:16], what=what,
                     refusals=self.refusals[peer_id], **context)
            last = now
        self._logged[peer_id] = last
        while len(self._logged) > MAX_REFUSING:
            self._logged.popitem(last=False)

    # --- our own credentials --------------------------------------------------------------------

    def hold(self, token: MembershipToken) -> None:
        """Use `token` for run (owner, run) from now on (it must name this peer)."""
        if token.peer != self.identity.peer_id:
            raise MembershipError(f"this token is for peer {token.peer}, not for this node "
                                  f"({self.identity.peer_id}); ask the run's owner for one")
        self._check_fresh(token)
        secrets = token.run_keys(self.identity)
        self._held[(token.owner, token.run)] = token
        # (what it learned before goes: a board re-learns newer generations as it starts)
        self._secrets[(token.owner, token.run)] = RunKeys(token.generation, secrets)

    def held(self, owner: str, run: str) -> MembershipToken | None:
        return self._held.get((owner, run))

    def keep_secret(self, run: str, secret: RunSecret) -> None:
        """The secret of a closed run this node owns (its ledger keeps it), of generation 0."""
        self.keep_keys(run, 0, [secret], 0.0)

    def keep_keys(self, run: str, generation: int, secrets: Sequence[RunSecret],
                  grace: float, rekeyed: float | None = None) -> None:
        """The secrets of a closed run this node owns (ownership.py's `on_keys`)."""
        self.learn_keys(self.identity.peer_id, run, generation, secrets, grace, rekeyed)

    def learn_keys(self, owner: str, run: str, generation: int, secrets: Sequence[RunSecret],
                   grace: float, rekeyed: float | None = None) -> bool:
        """Hold the run's secrets of `generation`, `generation - 1`, ... (newest first); True if
        that generation is new here: it is written with `grace` seconds after `rekeyed` or, if
        that is unknown, after now (RunKeys.learn; until then with the one before, if given)."""
        keys = self._secrets.get((owner, run))
        if keys is None:
            start = 0 if grace <= 0 or generation == 0 or len(secrets) < 2 else 1
            keys = self._secrets[(owner, run)] = RunKeys(generation - start, secrets[start:])
            if not start:
                return True
        return keys.learn(generation, secrets, self._clock(), grace, rekeyed)

    def now(self) -> float:
        """This registry's clock (unix seconds)."""
        return self._clock()

    def keys(self, owner: str, run: str) -> RunKeys | None:
        """The generations of run's secret this node holds."""
        return self._secrets.get((owner, run))

    def credential(self, key: str) -> str | None:
        """The token to present with a request about `key` (None: open run, or we own it)."""
        closed = closed_run_of(key)
        if closed is None or closed[0] == self.identity.peer_id:
            return None
        token = self._held.get(closed)
        return None if token is None else token.encode()

    # --- revocations ----------------------------------------------------------------------------

    def learn(self, revocations: Revocations) -> bool:
        """Keep `revocations` unless a list of the same run with a higher version is known."""
        key = (revocations.owner, revocations.run)
        known = self._revocations.get(key)
        if known is not None and known.version >= revocations.version:
            return False
        self._revocations[key] = revocations
        return True

    def revocations(self, owner: str, run: str) -> Revocations | None:
        return self._revocations.get((owner, run))

    # --- checks ---------------------------------------------------------------------------------

    def _token(self, text: str) -> MembershipToken:
        found = self._decoded.get(text)
        if found is None:
            try:
                found = MembershipToken.decode(text)
            except MembershipError as exc:
                found = exc
            self._decoded[text] = found
            while len(self._decoded) > 4096:
                self._decoded.popitem(last=False)
        if isinstance(found, MembershipError):
            raise found
        return found

    def check_own(self, token: MembershipToken) -> None:
        """MembershipError if a token we hold has expired or was revoked."""
        self._check_fresh(token)

    def _check_fresh(self, token: MembershipToken) -> None:
        now = self._clock()
        if token.expires <= now:
            raise MembershipError(f"the token (serial {token.serial}) of run {token.run!r} expired "
                                  f"{now - token.expires:.0f} s ago; ask the run's owner for a new one")
        revoked = self._revocations.get((token.owner, token.run))
        if revoked is not None and revoked.revokes(token):
            raise MembershipError(f"the token (serial {token.serial}) of run {token.run!r} was "
                                  "revoked by the run's owner")

    def check(self, peer_id: str, owner: str, run: str, token_text: Any, what: str) -> MembershipToken | None:
        """Pass if `peer_id` may do `what` in closed run (owner, run); raise NotAMember, counted."""
        if peer_id == owner:
            return None
        try:
            if not isinstance(token_text, str) or not token_text:
                raise MembershipError("no token was presented")
            token = self._token(token_text)
            if token.owner != owner or token.run != run:
                raise MembershipError(f"the token is for run {token.run!r} of owner "
                                      f"{token.owner[:16]}, not this one")
            if token.peer != peer_id:
                raise MembershipError(f"the token is for peer {token.peer[:16]}, not for the caller")
            self._check_fresh(token)
        except MembershipError as exc:
            self._refuse(peer_id, what, run=run, reason=str(exc))
            raise NotAMember(f"peer {peer_id[:16]} is not a member of closed run {run!r} ({what}): "
                             f"{exc}") from None
        return token

    def check_key(self, peer_id: str, key: str, token_text: Any, what: str) -> None:
        """`check` for a request about DHT-style `key`; nothing to check for open runs' keys."""
        closed = closed_run_of(key)
        if closed is not None:
            self.check(peer_id, closed[0], closed[1], token_text, what)

    def authorize_read(self, peer_id: str, key: str, token_text: Any) -> None:
        """May `peer_id` read DHT `key`? The revocation list is public; the rest needs a token."""
        closed = closed_run_of(key)
        if closed is None or key == revocations_key(*closed):
            return
        self.check(peer_id, closed[0], closed[1], token_text, "dht_read")

    def authorize_write(self, signer: str, key: str, proof: Any) -> None:
        """May a record of `signer` be stored under `key`? Only the owner writes the revocations."""
        closed = closed_run_of(key)
        if closed is None:
            return
        if _owners_only(key, closed):
            if signer != closed[0]:
                self._refuse(signer, "dht_write", run=closed[1], reason="not the owner")
                raise NotAMember(f"only the run's owner writes the revocation list and re-keying "
                                 f"records of {closed[1]!r}")
            return
        self.check(signer, closed[0], closed[1], proof, "dht_write")

    def tokens(self) -> list[str]:
        """Every token we hold (a relay that serves members only asks for them)."""
        return [token.encode() for token in self._held.values()]

    def admit_relay(self, peer_id: str, tokens: Any) -> None:
        """relay.members_only: `peer_id` must hold a valid token of a closed run this node takes
        part in (one it owns, or one it holds a token of). PermissionError (counted) if not."""
        for text in tokens if isinstance(tokens, list) else []:
            try:
                token = self._token(text) if isinstance(text, str) else None
            except MembershipError:
                continue
            if token is None or token.peer != peer_id:
                continue
            ours = token.owner == self.identity.peer_id or (token.owner, token.run) in self._held
            if not ours:
                continue
            try:
                self._check_fresh(token)
            except MembershipError:
                continue
            return
        self._refuse(peer_id, "relay", reason="no valid token")
        raise PermissionError(f"peer {peer_id[:16]} presented no valid token of a closed run "
                              "this relay takes part in")

    def stored(self, entry: Entry) -> None:
        """A DHT record stored on this node: learn a run's revocation list from its owner."""
        closed = closed_run_of(entry.key)
        if closed is None or entry.key != revocations_key(*closed) or entry.signer != closed[0]:
            return
        try:
            self.learn(Revocations.from_bytes(entry.value, *closed))
        except MembershipError as exc:
            log.info("revocations_malformed", run=closed[1], error=str(exc))

    # --- the records' secrecy -------------------------------------------------------------------

    def _secret_of(self, key: str) -> tuple[tuple[str, str], RunKeys | None] | None:
        """(run, its secrets if this node holds them) for a key whose values are encrypted, else
        None (an open run's key, or a closed run's owner's records)."""
        closed = closed_run_of(key)
        if closed is None or _owners_only(key, closed):
            return None
        return closed, self._secrets.get(closed)

    def conceal(self, key: str, sub_key: str | None, value: bytes) -> bytes:
        """The value to store under `key`: encrypted with the run's secret under a closed run's
        keys (NotAMember if this node holds none: nothing goes out in clear), else as it is."""
        found = self._secret_of(key)
        if found is None:
            return value
        (owner, run), secret = found
        if secret is None:
            raise NotAMember(f"this node holds no key of closed run {run!r} (owner "
                             f"{owner[:16]}), so it cannot write its records; join the run "
                             "with a token from its owner first")
        return secret.writer(self._clock()).encrypt(self.identity.peer_id, key, sub_key, value)

    def reveal(self, entry: Entry) -> bytes | None:
        """The plain value of `entry` read from the DHT; None when it does not decrypt (counted
        against its writer, a member: only members' records are stored) or this node holds no
        key of its run."""
        found = self._secret_of(entry.key)
        if found is None:
            return entry.value
        (_, run), secret = found
        if secret is None:
            return None
        try:
            return secret.decrypt(entry.signer, entry.key, entry.sub_key, entry.value)
        except RecordUnreadable as exc:
            self._refuse(entry.signer, "unreadable_record", run=run, key=entry.key[:120],
                         reason=str(exc))
            return None

    def stats(self) -> dict[str, Any]:
        return {"held": [{"owner": o, "run": r, "serial": t.serial, "role": t.role,
                          "expires": t.expires} for (o, r), t in self._held.items()],
                "refusals": sum(self.refusals.values()),
                "refusals_by_peer": dict(heapq.nlargest(20, self.refusals.items(),
                                                        key=lambda item: item[1])),
                "refusals_by_reason": dict(self.refusals_by_reason)}
