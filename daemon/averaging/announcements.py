"""Steps 1 and 2 of matchmaking (matchmaking.py) where the caller does not know its round's peers:
each peer announces itself in the DHT, a sub-key of `averaging/<key>` named by its own peer id
(only it can write that), holding its `Member` info and how to reach it, expiring when its window
closes; and it reads the key until the window closes, or until it has seen `expected` peers, past
the window while fewer than `min_trainers` trainers are seen. Only sub-keys written by the peer
they name count (anyone may write "1", "11", ..., which would sort first), and a peer banned here
(bans.py) is no candidate.
"""

from __future__ import annotations

import asyncio

import orjson
import structlog

from .. import timebase
from ..dht import DHTNode
from ..net import PeerTransport, TransportError
from .bans import BanList
from .group import Member
from .round_request import EXTEND_WINDOWS, MAX_ADDRESSES, RoundRequest, grace, member_from

log = structlog.get_logger(__name__)

DHT_PREFIX = "averaging/"
POLL_SECONDS = (0.01, 0.2)  # between DHT reads while gathering: first, and at most (backing off)
# Each read returns every announcement so far: with n peers polling, gathering costs n^2 entries
# a poll. So the pause grows with what was seen (0.2 s per 16 announcements, at most
# MAX_POLL_SECONDS), and a read asks READ_REPLICAS of the key's nodes (an announcement is
# stored on all of them): 64 peers polling every 0.2 s all 8 replicas saturated two cores.
MAX_POLL_SECONDS = 1.0
READ_REPLICAS = 3


class Announcements:
    """This peer's announcements under a round's key, and its reads of the others'."""

    def __init__(self, transport: PeerTransport, dht: DHTNode, bans: BanList) -> None:
        self._transport = transport
        self._dht = dht
        self._bans = bans
        self.peer_id = transport.peer_id

    async def announce(self, request: RoundRequest, window_end: float) -> None:
        info = {**request.member.to_json(), "size": request.size, "compression": request.compression,
                "chunk_elements": request.chunk_elements, "aggregation": request.aggregation,
                # how to reach us: a candidate may never have met us (a newcomer, a big swarm)
                "addresses": [str(a) for a in self._transport.listen_addresses()[:MAX_ADDRESSES]]}
        try:
            await self._dht.store(DHT_PREFIX + request.key, orjson.dumps(info),
                                  window_end + 2 * grace(request), sub_key=self.peer_id,
                                  timeout=max(0.5, window_end - timebase.now()))
        except (TransportError, TimeoutError) as exc:
            log.warning("matchmaking_announce_failed", key=request.key, error=str(exc))

    async def gather(self, request: RoundRequest, window_end: float) -> tuple[dict[str, Member], float]:
        """Read the announcements until the window closes or `expected` peers are seen; past the
        window while fewer than `min_trainers` trainers are seen (see RoundRequest). Returns
        them and when the gathering ended."""
        seen: dict[str, Member] = {self.peer_id: request.member}
        pause = POLL_SECONDS[0]
        latest = min(window_end + (EXTEND_WINDOWS - 1) * request.window,
                     request.deadline - 4 * grace(request))
        while True:
            remaining = window_end - timebase.now()
            if remaining <= 0:
                trainers = sum(1 for m in seen.values() if m.role != "aux")
                if trainers >= request.min_trainers or timebase.now() >= latest:
                    break
                window_end = min(latest, timebase.now() + request.window / 2)
                await self.announce(request, window_end)  # keep being seen meanwhile
                continue
            try:
                # the last read of the window asks every node of the key (a lookup cut short or
                # an old route may miss the writer's nearest nodes)
                record = await self._dht.get(DHT_PREFIX + request.key, timeout=max(0.2, remaining),
                                             replicas=None if remaining <= pause else READ_REPLICAS)
            except (TransportError, TimeoutError) as exc:
                log.debug("matchmaking_read_failed", key=request.key, error=str(exc))
                record = None
            # (only sub-keys written by the peer they name: anyone may write "1", "11", ...,
            # which would sort first and use up the attempts to settle)
            for sub_key, entry in (record.own_sub_keys.items() if record is not None else ()):
                found = member_from(entry.value, sub_key, request)
                if found is not None:
                    member, addresses = found
                    if sub_key not in seen and addresses:
                        self._transport.learn_addresses(sub_key, addresses, first_hand=False)
                    seen[sub_key] = member
            if request.expected is not None and len(seen) >= request.expected:
                break
            await asyncio.sleep(min(pause, max(0.0, window_end - timebase.now())))
            pause = min(pause * 2, _poll_cap(len(seen)))
        for peer_id in [p for p in seen if p != self.peer_id and self._bans.banned(p) is not None]:
            self._bans.refused(peer_id, "candidate")
            del seen[peer_id]
        return seen, max(window_end, timebase.now())


def _poll_cap(seen: int) -> float:
    """The longest pause between reads while gathering, having seen `seen` announcements."""
    return min(MAX_POLL_SECONDS, POLL_SECONDS[1] * max(1.0, seen / 16))
