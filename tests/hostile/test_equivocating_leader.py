"""A leader that tells its members different groups under one id: three honest dedlocd processes
and one that, leading, sends its first follower the group with its own weight halved (the
test-only switch DEDLOC_TEST_EQUIVOCATING_LEADER, corruption.py), signed as the true one is.
The members' streams, chunks and answers name their round by a digest of the group each was
told and carry the leader's signature of it (signatures.py): each honest member meets the other
group's name with the leader's signature, which proves that the leader signed two groups under
one id. Every honest member bans the leader at once, none of them is counted an offence (before,
the follower told otherwise counted honest senders an offence for "their" weight, and three such
rounds banned them), and the next round averages the honest three to their exact weighted mean."""

from __future__ import annotations

from typing import Any

from hostile.test_wrong_average import (
    ARGS,
    average,
    banned_by_the_honest_three,
    the_honest_three_average_without_it,
)
from support import swarm_with_odd_one

from dedloc.daemon.averaging.round_request import ranked


def led_by(peer_id: str, peers: list[str], prefix: str) -> str:
    """A round key under which `peer_id` ranks first to lead among `peers` (leaders are ranked
    by a hash of the key and the peer id: about one key in len(peers))."""
    return next(key for key in (f"{prefix}/{n}" for n in range(10_000))
                if ranked(key, peers)[0] == peer_id)


async def test_a_leader_that_tells_members_different_groups_is_banned_by_every_member(
        daemon_factory: Any) -> None:
    daemons = await swarm_with_odd_one(daemon_factory, ARGS, "bad", {
        "DEDLOC_TESTING": "1", "DEDLOC_TEST_EQUIVOCATING_LEADER": "1"})
    ids = [(await daemon.call("node.info"))["peer_id"] for daemon in daemons]
    bad = ids[3]
    reports, _, _ = await average(daemons, led_by(bad, ids, "two-groups"), 0, "none")
    assert all(r["group_size"] == 4 for r in reports), reports  # it led all four
    await banned_by_the_honest_three(daemons, bad)
    for daemon in daemons[:3]:
        info = await daemon.call("node.info")
        counters = info["counters"]
        assert counters["averaging.offences_leader_equivocation"] == 1, counters
        assert counters["averaging.allreduce.group_mismatches"] >= 1, counters
        status = await daemon.call("averaging.status")
        # nobody honest is counted an offence for what the leader did
        assert not status["bans"]["offenders"], status["bans"]
    await the_honest_three_average_without_it(daemons, bad, "two-groups/after")
