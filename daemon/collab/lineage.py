"""Lineages: a short name for the history of a peer's model state.

Every state a run's trainers hold descends from the run's initial state by a chain of steps
(one per epoch, each the outcome of one averaging round) and of state averagings. A lineage is a
hash of that chain: `initial_lineage(manifest)` for the state every peer starts from, then
`next_lineage(lineage, round_id)` after each round, where `round_id` is what every member of the
round agrees on (the group id the leader gave it). Two peers with the same epoch and lineage went
through the same rounds from the same state, so they hold the same parameters (up to float
rounding); two with the same epoch and different lineages diverged (a partition, a round that
only some of them stepped) although their epochs agree. Lineages travel in progress reports
(the run's head is an epoch *and* a lineage, see estimate.py), in averaging keys (only peers of
one lineage average together), with downloaded states and in checkpoints.

A lineage proves nothing by itself (anyone can name one); it only lets honest peers tell apart
histories that their epochs alone would mix up.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["LINEAGE_CHARS", "initial_lineage", "is_lineage", "next_lineage"]

LINEAGE_CHARS = 32
_LINEAGE = re.compile(r"^[0-9a-f]{32}$")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:LINEAGE_CHARS]


def initial_lineage(fingerprint: str) -> str:
    """The lineage of a run's initial state (the same on every peer: the manifest pins the
    initialisation)."""
    return _digest(f"dedloc-lineage/init/{fingerprint}")


def next_lineage(lineage: str, round_id: str) -> str:
    """The lineage after a step or a state averaging in the round named `round_id`."""
    return _digest(f"dedloc-lineage/{lineage}/{round_id}")


def is_lineage(value: object) -> bool:
    return isinstance(value, str) and bool(_LINEAGE.match(value))
