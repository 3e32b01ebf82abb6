"""A closed run's revocation list: the owner's revoked token serials and peers, and the run
secret's current generation (the owner's re-keying records, rekeying.py).

The one record under a closed run's keys that anyone may read and only the owner may write; where
it lives and how members and the checks use it: membership.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from .errors import MembershipError
from .secrecy import MAX_GENERATION

if TYPE_CHECKING:
    from .tokens import MembershipToken

_REVOCATIONS_DOMAIN = b"dedloc-run-revocations-v1\0"
REVOCATIONS_REFRESH = 30.0
MAX_REKEY_CHUNKS = 32  # re-keying records of a run (rekeying.py)
_KEY_ID_HEX = re.compile(r"[0-9a-f]{8}")


@dataclass(frozen=True)
class Revocations:
    """The owner's list of revoked token serials and peers of one run; `version` orders lists.
    `generation` is the run secret's current one, sealed to each member in the `chunks`
    re-keying records (rekeying.py; none while it is 0), `key_id` its key id (hex: which secret
    that number is, should the owner ever draw one twice) and `rekeyed` when those records were
    first stored (the owner's clock; None until then): the members' grace runs from then."""

    owner: str
    run: str
    version: float
    serials: frozenset[str] = frozenset()
    peers: frozenset[str] = frozenset()
    generation: int = 0
    chunks: int = 0
    key_id: str = ""
    rekeyed: float | None = None

    def to_bytes(self) -> bytes:
        data: dict[str, Any] = {"owner": self.owner, "run": self.run, "version": self.version,
                                "serials": sorted(self.serials), "peers": sorted(self.peers),
                                "generation": self.generation, "chunks": self.chunks}
        if self.key_id:
            data["key_id"] = self.key_id
        if self.rekeyed is not None:
            data["rekeyed"] = self.rekeyed
        return orjson.dumps(data)

    @classmethod
    def from_bytes(cls, data: bytes, owner: str, run: str) -> Revocations:
        try:
            raw = orjson.loads(data)
            if (not isinstance(raw, dict) or raw.get("owner") != owner or raw.get("run") != run
                    or not isinstance(raw.get("version"), int | float)
                    or not all(isinstance(s, str) for s in raw.get("serials", []))
                    or not all(isinstance(p, str) for p in raw.get("peers", []))):
                raise ValueError("wrong fields")
            generation, chunks = raw.get("generation", 0), raw.get("chunks", 0)
            if (type(generation) is not int or type(chunks) is not int
                    or not 0 <= generation <= MAX_GENERATION or not 0 <= chunks <= MAX_REKEY_CHUNKS
                    or (generation > 0) != (chunks > 0)):
                raise ValueError(f"generation {generation!r} with {chunks!r} re-keying records")
            key_id, rekeyed = raw.get("key_id", ""), raw.get("rekeyed")
            if not isinstance(key_id, str) or (key_id and not _KEY_ID_HEX.fullmatch(key_id)):
                raise ValueError(f"key id {str(key_id)[:20]!r}")
            if rekeyed is not None and (not isinstance(rekeyed, int | float) or isinstance(
                    rekeyed, bool) or not 0 <= rekeyed < math.inf):
                raise ValueError(f"re-keyed at {str(rekeyed)[:20]!r}")
        except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
            raise MembershipError(f"malformed revocation list of run {run!r}: {exc}") from None
        return cls(owner, run, float(raw["version"]), frozenset(raw.get("serials", [])),
                   frozenset(raw.get("peers", [])), generation, chunks, key_id,
                   None if rekeyed is None else float(rekeyed))

    def revokes(self, token: MembershipToken) -> bool:
        return token.serial in self.serials or token.peer in self.peers
