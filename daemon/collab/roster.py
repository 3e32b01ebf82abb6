"""The roster of a grid round: one list of who holds the cells, the same on every peer.

A grid round (grid.py) gives its cells by rank among the trainers it is laid out on, so one
trainer more in one peer's list moves most of the others to other slices, and the round fails
for nearly everyone. Views differ in two ways. A peer that knows no round that made the head
(the run's first round, or the first after a restart) sees the trainers at the head, and while
trainers are still arriving (a run that starts, a flash crowd) views differ by the last few
newcomers. Measured in the simulator (64 trainers joining one every ~2 s, groups of 16): 18
different layouts in the first round, 172 failed rounds over 80 simulated seconds. A later round
gives its cells to the trainers that stepped in the round that made the head, as the board says,
and peers read the board at different moments, a report or two apart (128 trainers, groups of
32: 5 different lists in one epoch, most of its rounds failed).

So every grid round has a *roster*: the first `WRITERS` trainers of its view, in an order
by a hash of the round's key (`writers`), publish the trainers they see under the round's key
in the DHT (one sub-key each, signed) as they begin the round; every peer then lays the grid
out on the roster published *first* (`pick`: the earliest publication time the writers signed,
ties by rank), waiting at most `wait` seconds for one, and once one is out, until it is
`SETTLE` seconds old (a writer that began at the same moment is then seen too). Peers begin a
round seconds apart; the first roster is out before the later ones look, so they all take it,
and a writer that finds a roster it would take already out publishes none (a writer whose clock
runs behind would otherwise sign an earlier time after the fact and take the later readers away
from the first roster).
(The first rule, the best-ranked writer's roster, split a 128-peer round in two: peers that
began early waited `wait` for the best-ranked writer, then took another's; those that began
after it came took its.) A roster is taken only from a writer among the first
`WRITERS + WRITER_SLACK` of the reader's own view, and only if it agrees with that view
(`agrees`: it holds most of the trainers the reader sees, and few it does not know; in a first
round the view is every trainer seen at the head, while a writer publishes only those it has
seen there for a while: `Rosters.agree`, `publishes`), so a
stranger cannot hand out the cells, and trainers missing from the roster help like newcomers
(grid.py). What remains: one of those writers (an identity at the head, which a forged progress
report can put there once the round's key is known) can sign an early publication time and
write a roster that agrees but moves up to half the trainers out of the cells and a quarter of
them to ids that never come; the round then fails, and the next one ranks writers anew. In a
first round, identities that appear at the head just before it count in every reader's view:
as many as the honest trainers make every honest roster disagree, and each peer lays out its
own grid (the round fails). The
roster stays in the DHT for `TTL` seconds: a round that failed and runs again under the same key
lays out the same grid.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
import structlog

from .. import timebase
from ..net import TransportError

if TYPE_CHECKING:
    from ..dht import DHTNode

log = structlog.get_logger(__name__)

__all__ = ["MAX_ROSTER", "TTL", "WRITERS", "Published", "Rosters", "agrees", "decode_record",
           "encode", "pick", "publishes", "writers"]

WRITERS = 3  # trainers that publish their view of a grid round
# a roster is taken only from a writer among the first WRITERS + WRITER_SLACK of the reader's own
# view (views differ by a few peers; a stranger outside the view cannot hand out the cells)
WRITER_SLACK = 2
TTL = 180.0  # seconds a roster stays in the DHT
POLL = 0.25  # the first pause between reads while waiting for a roster
MAX_POLL = 1.0  # the pause doubles up to this (every peer of a grid round reads one key)
MAX_ROSTER = 1024  # peers a roster may list
MAX_PEER_ID = 128  # characters of one peer id in a roster
DHT_TIMEOUT = 2.0
SETTLE = 1.0  # a roster is taken once it is this old (a near-simultaneous earlier one is seen)
LOGGED_ROSTERS = 8  # rosters a peer that took none names in its log


@dataclass(frozen=True)
class Published:
    """A writer's roster and when it says it published it (its record's expiration less TTL)."""

    roster: tuple[str, ...]
    at: float
    # the trainers (ids) and the number of aux peers the writer saw beside the roster (None: a
    # writer of an earlier version said nothing): the helpers a grid round is laid out for, the
    # same on every peer that takes this roster (grid.py: how many stages depends on them,
    # where they sit too, and views of them differ)
    helpers: tuple[tuple[str, ...], int] | None = None


def _rank(key: str, peer: str) -> bytes:
    return hashlib.sha256(f"{key}\0roster\0{peer}".encode()).digest()


def writers(key: str, trainers: Iterable[str], count: int = WRITERS) -> list[str]:
    """The trainers that publish a roster of the round `key`, best-ranked first."""
    return sorted(set(trainers), key=lambda peer: _rank(key, peer))[:count]


def agrees(roster: Collection[str], view: Collection[str]) -> bool:
    """Whether a roster may stand for this peer's `view` of the trainers at the head: it holds
    more than half of them, and at most a quarter of it are peers the view does not know."""
    members, seen = set(roster), set(view)
    return 2 * len(members & seen) > len(seen) and 4 * len(members - seen) <= len(members)


def pick(key: str, view: Collection[str], entries: Mapping[str, Published]
         ) -> tuple[str, Published] | None:
    """(writer, its roster) of the roster published first (ties: the best-ranked writer) among
    those that agree with `view`, or None. Only writers among the first WRITERS + WRITER_SLACK
    of `view` count."""
    allowed = set(writers(key, view, WRITERS + WRITER_SLACK))
    good = [(writer, entry) for writer, entry in entries.items()
            if writer in allowed and agrees(entry.roster, view)]
    return min(good, key=lambda item: (item[1].at, _rank(key, item[0])), default=None)


def publishes(key: str, peer: str, view: Collection[str], drawn: Collection[str]) -> bool:
    """Whether `peer` writes a roster of the round `key`: it is one of the first WRITERS of its
    `view`, or of the part it would publish (`drawn`, which holds it) while among the first
    WRITERS + WRITER_SLACK of its view (where every reader takes it from). A first round's
    drawn part is what the peer settled, and those parts differ widely: a writer ranked 6th of
    12 that had settled 7 published first, a reader that had settled few took its 7, one that
    had settled all the best-ranked writer's 12 (when writers were admitted by either rank)."""
    if peer not in drawn:
        return False
    return peer in writers(key, view) or (peer in writers(key, drawn)
                                          and peer in writers(key, view, WRITERS + WRITER_SLACK))


def encode(roster: Iterable[str], helpers: tuple[Iterable[str], int] | None = None) -> bytes:
    """A roster's record: its trainers and, if given, the helpers its writer saw beside them
    (trainers, and the number of aux peers)."""
    cells = sorted(set(roster))
    if helpers is None:
        return orjson.dumps(cells)
    return orjson.dumps({"cells": cells, "helpers": sorted(set(helpers[0]) - set(cells)),
                         "aux": helpers[1]})


def _peers(data: object, least: int) -> tuple[str, ...] | None:
    if not isinstance(data, list) or not least <= len(data) <= MAX_ROSTER \
            or not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID for p in data) \
            or len(set(data)) != len(data):
        return None
    return tuple(data)


def decode_record(value: bytes) -> tuple[tuple[str, ...], tuple[tuple[str, ...], int] | None] | None:
    """A roster's record as published: its trainers and the helpers its writer said it saw
    (trainers, the number of aux peers; None where it said none), or None when it is not one
    (at most MAX_ROSTER peers in all; junk is ignored, not fatal)."""
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        cells = _peers(data, 1)
        return None if cells is None else (cells, None)
    if set(data) != {"cells", "helpers", "aux"}:
        return None
    cells, helpers, aux = _peers(data["cells"], 1), _peers(data["helpers"], 0), data["aux"]
    if cells is None or helpers is None or type(aux) is not int \
            or not 0 <= aux <= MAX_ROSTER or len(cells) + len(helpers) > MAX_ROSTER \
            or set(cells) & set(helpers):
        return None
    return cells, (helpers, aux)


@dataclass
class _Reads:
    """How one peer's reads of a round's roster went (for its log when none was taken)."""

    done: int = 0
    failed: int = 0


class Rosters:
    """Rosters of one run's grid rounds, through the DHT (see the module docstring)."""

    def __init__(self, dht: DHTNode, peer_id: str, run_key: str) -> None:
        self.dht = dht
        self.peer_id = peer_id
        self.run_key = run_key

    async def agree(self, key: str, trainers: Collection[str], *, wait: float,
                    write: bool = True, seen: Collection[str] = (),
                    helpers: tuple[tuple[str, ...], int] | None = None
                    ) -> tuple[tuple[str, ...], tuple[tuple[str, ...], int] | None]:
        """The trainers a grid round of `key` gives its cells to, and the helpers (trainers,
        the number of aux peers) their writer saw beside them: the first-published roster that
        agrees with this peer's view (`trainers`, itself included if it trains, and `seen`),
        waited for at most `wait` seconds; else `trainers` and `helpers`. This peer writes
        `trainers` (and `helpers`) as a roster if it is one of the writers (`publishes`) and `write` allows.
        (`seen`: the trainers this peer sees at the head beyond those it would publish; a first
        round publishes only those seen there for a while, `Timing.settle`, and judges a roster
        by all: peers that began together see each other arrive at different moments, so the
        settled parts of their views differ far more than the views; judged by those parts, a
        peer that settled few refused the rosters of those that settled all, published its own,
        and a 12-trainer run never stepped: 221 failed rounds in 200 simulated seconds)"""
        drawn = frozenset(trainers)
        view = drawn | frozenset(seen)
        dht_key = f"{self.run_key}/roster/{key}"
        reads = _Reads()
        entries = await self._read(dht_key, reads=reads)
        # a writer that finds a roster it would take already out does not publish its own: a
        # later roster could only be ordered before it by a signed time, and a writer whose
        # clock runs behind would then split the round between those that took the first
        # (seen in the simulator: clocks 3 s apart, a 24-peer step 3.3e-3 apart)
        # (only a roster of one of the first WRITERS counts for that: one from the slack ranks
        # may not be taken by readers whose views rank it lower, and they need an honest one)
        first = set(writers(key, view))
        wrote: bool | None = None  # None: not a writer of this round (or one was out already)
        if write and publishes(key, self.peer_id, view, drawn) and self.peer_id not in entries \
                and pick(key, view, {w: e for w, e in entries.items() if w in first}) is None:
            published = await self._write(dht_key, drawn, helpers)
            wrote = published is not None
            if published is not None:
                entries[self.peer_id] = published
        give_up = timebase.monotonic() + max(0.0, wait)
        pause = POLL
        while True:
            chosen = pick(key, view, entries)
            left = give_up - timebase.monotonic()
            if chosen is not None:
                # taken once it is SETTLE old: one published at about the same moment (and
                # signed a little earlier) is in the DHT by then
                # (also past `wait`, by at most SETTLE: a peer that waited long for any roster
                # took the first it saw at once, while an earlier one, slower to store, was not
                # out yet; a roster dated in the future, a skewed or hostile writer's, holds no
                # one longer than that)
                young = min(SETTLE, SETTLE - (timebase.now() - chosen[1].at), left + SETTLE)
                if young <= 0:
                    break
                await asyncio.sleep(young)
            else:
                if left <= 0:
                    break
                await asyncio.sleep(min(pause, left))
                pause = min(MAX_POLL, 2 * pause)
            entries = {**entries, **await self._read(dht_key, reads=reads)}
        if chosen is None:
            # what was read and why none was taken: per roster, whether its writer ranks among
            # those this peer takes from and whether it agrees with the view; at most
            # LOGGED_ROSTERS, those writers first (anyone may write a sub-key under the key)
            allowed = set(writers(key, view, WRITERS + WRITER_SLACK))
            shown = sorted(entries, key=lambda w: (w not in allowed, _rank(key, w)))[:LOGGED_ROSTERS]
            log.info("grid_roster_missing", key=key, trainers=len(drawn), view=len(view),
                     reads=reads.done, reads_failed=reads.failed, wrote=wrote,
                     writers=[w[:12] for w in writers(key, view)], rosters_out=len(entries),
                     out={w[:12]: {"allowed": w in allowed, "size": len(entries[w].roster),
                                   "agrees": agrees(entries[w].roster, view)} for w in shown})
            return tuple(sorted(drawn)), helpers
        writer, entry = chosen
        log.debug("grid_roster", key=key, writer=writer[:12], trainers=len(entry.roster),
                  unseen=len(set(entry.roster) - view), missing=len(view - set(entry.roster)),
                  published_at=round(entry.at, 3),
                  others={w[:12]: round(e.at, 3) for w, e in entries.items() if w != writer})
        return entry.roster, entry.helpers

    async def published(self, key: str, trainers: Collection[str], *,
                        timeout: float = DHT_TIMEOUT) -> bool:
        """Whether a roster this peer would take (`pick`: from one of the first writers of its
        view of the `trainers`, agreeing with that view) is out for the round `key`: the round
        has begun (a peer still settling before it begins now, see policy.py)."""
        entries = await self._read(f"{self.run_key}/roster/{key}", timeout=timeout)
        return pick(key, frozenset(trainers), entries) is not None

    async def _read(self, dht_key: str, timeout: float = DHT_TIMEOUT,
                    reads: _Reads | None = None) -> dict[str, Published]:
        reads = reads if reads is not None else _Reads()
        reads.done += 1
        try:
            record = await self.dht.get(dht_key, timeout=max(0.1, min(DHT_TIMEOUT, timeout)))
        except (TransportError, TimeoutError) as exc:
            reads.failed += 1
            log.debug("grid_roster_read_failed", key=dht_key, error=str(exc))
            return {}
        out: dict[str, tuple[str, ...]] = {}
        for writer, entry in (record.own_sub_keys.items() if record is not None else ()):
            decoded = decode_record(entry.value)
            if decoded is not None:
                out[writer] = Published(decoded[0], entry.expiration - TTL, decoded[1])
        return out

    async def _write(self, dht_key: str, view: Collection[str],
                     helpers: tuple[tuple[str, ...], int] | None) -> Published | None:
        now = timebase.now()
        value = encode(view, helpers)
        try:
            await self.dht.store(dht_key, value, now + TTL, sub_key=self.peer_id,
                                 timeout=DHT_TIMEOUT)
        except (TransportError, TimeoutError) as exc:
            log.info("grid_roster_write_failed", key=dht_key, error=str(exc))
            return None
        log.debug("grid_roster_written", key=dht_key, trainers=len(set(view)))
        written = decode_record(value)  # (what readers will take: one rule, the decoder's)
        return None if written is None else Published(written[0], now, written[1])
