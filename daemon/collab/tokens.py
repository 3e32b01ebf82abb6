"""A closed run's membership token: an owner's signed permission for one peer to take part.

The token, its encoding (`dlt2.` claims and signature), and the run's secret it carries sealed to
its peer; what it is for and how the checks use it: membership.py.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from .. import timebase
from ..identity import Identity, verify
from ..sealing import SealError, open_sealed, seal
from .errors import MembershipError
from .secrecy import MAX_GENERATION, RunSecret, join_secrets, split_secrets

TOKEN_PREFIX = "dlt2"
OLD_TOKEN_PREFIXES = ("dlt1",)  # tokens without the run's key (before records were encrypted)
_TOKEN_DOMAIN = b"dedloc-run-token-v2\0"
_RUN_KEY_DOMAIN = b"dedloc-run-key-v1\0"
MAX_TOKEN_CHARS = 2048
ROLES = ("trainer", "aux")
SEALED_GENERATIONS = 2  # generations of the run's secret a token or a re-keying entry carries


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _run_key_context(owner: str, run: str) -> bytes:
    return _RUN_KEY_DOMAIN + owner.encode() + b"\0" + run.encode()


@dataclass(frozen=True)
class MembershipToken:
    """An owner's permission for one peer to take part in one run, until `expires`; `key` is the
    run's secret (generation `generation` and the one before) sealed to that peer (`run_keys`
    opens it)."""

    owner: str
    run: str
    peer: str
    role: str
    issued: float
    expires: float
    serial: str
    key: bytes = field(default=b"", repr=False)
    generation: int = 0
    signature: bytes = field(default=b"", repr=False)

    def _claims(self) -> dict[str, Any]:
        claims = asdict(self)
        del claims["signature"]
        claims["key"] = _b64(self.key)
        if not self.generation:  # (as tokens were before the secret had generations)
            del claims["generation"]
        return claims

    def signing_bytes(self) -> bytes:
        return _TOKEN_DOMAIN + orjson.dumps(self._claims(), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def issue(cls, owner: Identity, run: str, peer: str, role: str, seconds: float,
              secret: RunSecret, *, generation: int = 0,
              earlier: Sequence[RunSecret] = ()) -> MembershipToken:
        """A token carrying `secret` (of `generation`) and `earlier` (generation - 1, ...)."""
        if role not in ROLES:
            raise MembershipError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise MembershipError(f"a token must be valid for a positive time, not {seconds!r} s")
        try:
            sealed = seal(peer, join_secrets([secret, *earlier][:SEALED_GENERATIONS]),
                          _run_key_context(owner.peer_id, run))
        except SealError as exc:
            raise MembershipError(f"cannot issue a token to {peer[:60]!r}: {exc}") from None
        now = timebase.now()
        unsigned = cls(owner.peer_id, run, peer, role, now, now + seconds, os.urandom(8).hex(),
                       sealed, generation)
        return dataclasses.replace(unsigned, signature=owner.sign(unsigned.signing_bytes()))

    def run_secret(self, identity: Identity) -> RunSecret:
        """The run's secret of the token's generation (see `run_keys`)."""
        return self.run_keys(identity)[0]

    def run_keys(self, identity: Identity) -> list[RunSecret]:
        """Open the run's secrets, newest first (only the token's peer can); MembershipError if
        they do not open."""
        try:
            return split_secrets(open_sealed(identity, self.key,
                                             _run_key_context(self.owner, self.run)),
                                 min(SEALED_GENERATIONS, self.generation + 1))
        except (SealError, ValueError):
            raise MembershipError(f"the run key in the token (serial {self.serial}) of run "
                                  f"{self.run!r} does not open with this node's identity; ask the "
                                  "run's owner for a new token") from None

    def encode(self) -> str:
        return ".".join((TOKEN_PREFIX, _b64(orjson.dumps(self._claims())), _b64(self.signature)))

    @classmethod
    def decode(cls, text: str) -> MembershipToken:
        """Parse and check the owner's signature (not expiry or revocation); MembershipError."""
        if not isinstance(text, str) or len(text) > MAX_TOKEN_CHARS:
            raise MembershipError("a token is a string of at most 2048 characters")
        parts = text.strip().split(".")
        if parts[0] in OLD_TOKEN_PREFIXES:
            raise MembershipError(
                f"this token ({parts[0]}.) was issued by an older dedloc, before closed runs "
                "encrypted their records: it carries no run key. Ask the run's owner to upgrade "
                "and issue you a new one (dedloc token issue)")
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
            raise MembershipError(f"not a dedloc run token (it starts with {TOKEN_PREFIX}.)")
        try:
            claims = orjson.loads(_unb64(parts[1]))
            signature = _unb64(parts[2])
            key = _unb64(claims["key"]) if isinstance(claims, dict) and isinstance(
                claims.get("key"), str) else None
        except (orjson.JSONDecodeError, binascii.Error, ValueError) as exc:
            raise MembershipError(f"the token is garbled ({exc})") from None
        expected = {"owner": str, "run": str, "peer": str, "role": str, "issued": (int, float),
                    "expires": (int, float), "serial": str, "key": str}
        if isinstance(claims, dict) and "generation" in claims:
            expected["generation"] = int
        unknown = sorted(set(claims) - {*expected, "generation"}) if isinstance(claims, dict) else []
        if unknown:
            raise MembershipError(
                f"the token carries fields this dedloc does not know ({', '.join(unknown)[:200]}): "
                "it was issued by a newer version. Upgrade this node (every member of a closed run "
                "and the nodes it uses need the owner's version)")
        if key is None or not isinstance(claims, dict) or set(claims) != set(expected) or any(
                not isinstance(claims[k], kind) or isinstance(claims[k], bool)
                for k, kind in expected.items()) or not 0 <= claims.get("generation", 0) <= MAX_GENERATION:
            raise MembershipError("the token's fields are wrong (was it made by another version?)")
        token = cls(**{**claims, "key": key}, signature=signature)
        if token.role not in ROLES:
            raise MembershipError(f"the token's role {token.role!r} is unknown")
        if not verify(token.owner, signature, token.signing_bytes()):
            raise MembershipError(f"the token is not signed by the run's owner {token.owner[:16]}")
        return token
