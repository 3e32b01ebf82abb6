"""Node and key ids: 256-bit integers, compared by the XOR metric.

A node id is the SHA-256 of the peer id's bytes (its base58 text decoded); a key id is the SHA-256
of the key's UTF-8 text. Ids are plain ints so that distances are `a ^ b` and sort as numbers.
"""

from __future__ import annotations

import functools
import hashlib
import random

from ..identity import base58_decode

ID_BITS = 256
ID_SPACE = 1 << ID_BITS


@functools.lru_cache(maxsize=65536)
def node_id_of(peer_id: str) -> int:
    """The DHT id of a peer: SHA-256 of the peer id's bytes (ValueError if not base58)."""
    return int.from_bytes(hashlib.sha256(base58_decode(peer_id)).digest(), "big")


def key_id_of(key: str) -> int:
    """The DHT id of a key: SHA-256 of its UTF-8 text."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest(), "big")


def distance(a: int, b: int) -> int:
    """The XOR metric: symmetric, zero only for equal ids, and obeys the triangle inequality."""
    return a ^ b


def random_id_between(low: int, high: int, rng: random.Random | None = None) -> int:
    """A uniformly random id in [low, high)."""
    if not 0 <= low < high <= ID_SPACE:
        raise ValueError(f"empty or out-of-range id interval [{low}, {high})")
    return (rng or random).randrange(low, high)
