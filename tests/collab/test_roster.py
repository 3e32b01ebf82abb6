"""Rosters of grid rounds (collab/roster.py): pure rules, and peers whose views of the head (or
readings of the board) differ agreeing on one grid through an in-memory DHT, on virtual time (a
roster is taken once it is a second old: those waits cost no wall time)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import orjson
import pytest
from structlog.testing import capture_logs

from dedloc.daemon import timebase
from dedloc.daemon.averaging.averager import RoundOptions
from dedloc.daemon.averaging.settings import AveragingSettings
from dedloc.daemon.collab.grid import grid_layout
from dedloc.daemon.collab.roster import (
    LOGGED_ROSTERS,
    MAX_ROSTER,
    SETTLE,
    TTL,
    Published,
    Rosters,
    agrees,
    decode_record,
    encode,
    pick,
    publishes,
    writers,
)
from dedloc.daemon.collab.rounds import NetworkRounds

pytestmark = pytest.mark.virtual_time


def _ids(n: int, start: int = 0) -> list[str]:
    return [f"{i:04x}" + "cd" * 20 for i in range(start, start + n)]


def test_writers_depend_on_the_key_and_the_set_not_on_the_order() -> None:
    peers = _ids(50)
    assert writers("grad/0/x", peers) == writers("grad/0/x", list(reversed(peers)))
    assert writers("grad/0/x", peers) != writers("grad/1/x", peers)
    assert len(writers("grad/0/x", peers)) == 3 and len(writers("k", peers[:2])) == 2


def test_views_that_differ_by_newcomers_mostly_name_the_same_first_writer() -> None:
    base, newcomers = _ids(50), _ids(3, start=50)
    same = sum(writers(f"grad/{k}/x", base)[0] == writers(f"grad/{k}/x", [*base, *newcomers])[0]
               for k in range(200))
    assert same >= 180  # only where a newcomer ranks first (3 in 53: about 6%)


@pytest.mark.parametrize(("roster", "view", "expected"), [
    (range(10), range(10), True),
    (range(10), range(12), True),  # two the roster's writer had not seen yet: helpers
    (range(12), range(10), True),  # two we do not know yet: at most a quarter is unknown
    (range(5), range(10), False),  # half of our view is not a majority
    (range(6), range(10), True),
    (range(10, 20), range(10), False),  # strangers
    ([*range(6), *range(100, 103)], range(10), False),  # a third unknown to us: friends of the writer
])
def test_a_roster_is_taken_only_when_it_agrees_with_the_view(roster: range, view: range,
                                                              expected: bool) -> None:
    assert agrees([str(p) for p in roster], [str(p) for p in view]) is expected


def test_pick_takes_the_first_published_roster_that_agrees() -> None:
    view = _ids(20)
    ranked = writers("k", view, count=20)
    honest = tuple(view)
    friends = tuple([ranked[0], *_ids(30, start=100)])
    first, later = Published(honest, 2.0), Published(honest, 3.0)
    assert pick("k", view, {ranked[0]: Published(friends, 1.0), ranked[1]: later,
                            ranked[2]: first}) == (ranked[2], first)
    tie = Published(honest[:15], 2.0)  # published at the same moment: the better-ranked writer
    assert pick("k", view, {ranked[2]: first, ranked[1]: tie}) == (ranked[1], tie)
    assert pick("k", view, {ranked[0]: Published(friends, 1.0)}) is None


@pytest.mark.parametrize("value", [b"", b"{}", b"[]", b"[1, 2]", b'["a", "a"]', b'["' + b"x" * 200 + b'"]',
                                   b"not json",
                                   # helpers said: peer ids apart from the cells, a count of aux
                                   b'{"cells": ["a"], "helpers": ["b"]}',
                                   b'{"cells": ["a"], "helpers": 1, "aux": 0}',
                                   b'{"cells": ["a"], "helpers": ["a"], "aux": 0}',
                                   b'{"cells": ["a"], "helpers": ["b", "b"], "aux": 0}',
                                   b'{"cells": ["a"], "helpers": [2], "aux": 0}',
                                   b'{"cells": ["a"], "helpers": [], "aux": -1}',
                                   b'{"cells": ["a"], "helpers": [], "aux": 1e9}',
                                   b'{"cells": ["a"], "helpers": [], "aux": 100000}',
                                   b'{"cells": ["a"], "helpers": [], "aux": true}',
                                   b'{"cells": [], "helpers": ["b"], "aux": 0}',
                                   b'{"cells": ["a"], "helpers": [], "aux": 0, "more": 1}',
                                   b'{"cells": ["a"], "helpers": ' + orjson.dumps(
                                       [f"p{i}" for i in range(MAX_ROSTER)]) + b', "aux": 0}'])
def test_junk_is_no_roster(value: bytes) -> None:
    assert decode_record(value) is None


def test_a_roster_round_trips() -> None:
    assert decode_record(encode(["b", "a", "b"])) == (("a", "b"), None)
    assert decode_record(encode(["b", "a"])) == (("a", "b"), None)  # (an earlier writer's)
    assert decode_record(encode(["b", "a"], (("d", "c", "a"), 1))) == (("a", "b"), (("c", "d"), 1))


@dataclass
class _Entry:
    value: bytes
    expiration: float


@dataclass
class _Record:
    own_sub_keys: dict[str, _Entry]


class _Dht:
    """One shared store: what a writer stores, every reader gets (signatures aside)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, _Entry]] = {}

    async def store(self, key: str, value: bytes, expiration: float, sub_key: str | None = None,
                    *, timeout: float | None = None) -> int:
        assert sub_key is not None
        self.values.setdefault(key, {})[sub_key] = _Entry(value, expiration)
        return 1

    async def get(self, key: str, *, timeout: float | None = None) -> _Record | None:
        held = self.values.get(key)
        return None if held is None else _Record(dict(held))


async def test_views_differing_by_newcomers_lay_out_one_grid() -> None:
    key = "grad/0/init"
    base, newcomers = _ids(60), _ids(4, start=60)
    first = writers(key, base)[0]
    assert first not in newcomers
    dht = _Dht()

    def rosters(peer: str) -> Rosters:
        return Rosters(dht, peer, "run")  # type: ignore[arg-type]

    # the first writer goes first (it does not wait for anyone); the others find its roster
    views = {first: base, **{p: [*base, *newcomers[: i % 5]] for i, p in enumerate(base) if p != first}}
    chosen = {peer: (await rosters(peer).agree(key, view, wait=0.0))[0]
              for peer, view in views.items()}
    assert set(chosen.values()) == {tuple(sorted(base))}
    layouts = {peer: grid_layout(key, roster, 16) for peer, roster in chosen.items()}
    assert len({tuple(sorted(layout.cells.items())) for layout in layouts.values() if layout}) == 1
    # without rosters, those views lay out different grids
    own = {tuple(sorted(grid_layout(key, view, 16).cells.items()))  # type: ignore[union-attr]
           for view in views.values()}
    assert len(own) > 1


async def test_a_peer_that_takes_no_roster_logs_why_naming_a_bounded_number_of_rosters() -> None:
    """Strangers may each write a sub-key under a round's key: the log names the rosters the
    reader would take from first, and only LOGGED_ROSTERS of them."""
    dht, view, key = _Dht(), _ids(40), "k"
    strangers = _ids(50, start=500)
    for stranger in strangers:
        await dht.store(f"run/roster/{key}", encode(strangers), 0.0, sub_key=stranger)
    fifth = writers(key, view, 5)[-1]  # a writer we would take from, whose roster disagrees
    await dht.store(f"run/roster/{key}", encode(_ids(30, start=9000)), 0.0, sub_key=fifth)
    with capture_logs() as logs:
        roster, _ = await Rosters(dht, view[0], "run").agree(key, view, wait=0.0, write=False)  # type: ignore[arg-type]
    assert roster == tuple(sorted(view))
    [missing] = [entry for entry in logs if entry["event"] == "grid_roster_missing"]
    assert missing["rosters_out"] == 51 and missing["reads_failed"] == 0 and missing["wrote"] is None
    assert len(missing["out"]) == LOGGED_ROSTERS
    assert missing["out"][fifth[:12]] == {"allowed": True, "agrees": False, "size": 30}
    assert sum(why["allowed"] for why in missing["out"].values()) == 1


async def test_a_peer_that_may_not_write_and_finds_no_roster_keeps_its_view() -> None:
    dht = _Dht()
    view = _ids(40)
    peer = writers("k", view)[0]
    taken = await Rosters(dht, peer, "run").agree("k", view, wait=0.0, write=False)  # type: ignore[arg-type]
    assert taken == (tuple(sorted(view)), None)
    assert dht.values == {}


class _Averager:
    """Records the stage rounds a peer's grid round asks for (and runs none of them)."""

    def __init__(self, peer_id: str, max_group_size: int) -> None:
        self.peer_id = peer_id
        self.config = AveragingSettings(max_group_size=max_group_size, window=0.0)
        self.stages: dict[str, tuple[str, ...]] = {}
        self.coming_prefixes: list[str] = []

    async def average(self, vector: np.ndarray, options: RoundOptions) -> None:
        self.stages[options.key] = tuple(sorted({*options.peers, self.peer_id}))

    def coming(self, keys: Iterable[str]) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def coming_under(self, prefix: str) -> Iterator[None]:
        self.coming_prefixes.append(prefix)
        try:
            yield
        finally:
            self.coming_prefixes.remove(prefix)


async def test_a_later_grid_round_lays_out_one_grid_though_the_board_was_read_apart() -> None:
    # 64 trainers at the head; 60 of them reported they stepped there before every peer read
    # the board, and each of the last 4 made it into some peers' readings only
    key = "grad/7/abc"
    trainers, late = _ids(60), _ids(4, start=60)
    everyone = [*trainers, *late]
    first = writers(key, trainers)[0]
    dht = _Dht()
    peers = [first, *(p for p in everyone if p != first)]  # its writer reads first
    averagers = {p: _Averager(p, 16) for p in peers}
    for i, peer in enumerate(peers):
        rounds = NetworkRounds(averagers[peer], "run", dht)  # type: ignore[arg-type]
        stepped = tuple(sorted({*trainers, *late[: i % 5]}))
        await rounds.average(np.zeros(8, np.float32), key, weight=1.0, expected=64, role="trainer",
                             peers=tuple(p for p in everyone if p != peer), cells=stepped)
    # every slice of stage 0 is the same list for every peer in it
    slices: dict[str, set[tuple[str, ...]]] = {}
    for averager in averagers.values():
        for stage_key, members in averager.stages.items():
            if "/m0/" in stage_key:
                slices.setdefault(stage_key, set()).add(members)
    assert slices and all(len(seen) == 1 for seen in slices.values()), slices
    # without the roster (each peer on its own reading) they differ
    layouts = {tuple(sorted(grid_layout(key, sorted({*trainers, *late[: i % 5]}), 16)  # type: ignore[union-attr]
                            .cells.items())) for i in range(5)}
    assert len(layouts) > 1


def test_a_roster_from_a_writer_outside_the_view_or_its_first_ranks_is_not_taken() -> None:
    key, view = "grad/3/abc", _ids(40)
    stranger = next(p for p in _ids(5000, start=100) if writers(key, [*view, p])[0] == p)
    low = writers(key, view, len(view))[-1]  # in the view, ranked last
    roster = Published(tuple(sorted(view)), 5.0)
    early = Published(roster.roster, 1.0)
    assert pick(key, view, {stranger: early, low: early}) is None
    honest = writers(key, view)[1]
    assert pick(key, view, {stranger: early, low: early, honest: roster}) == (honest, roster)


async def test_a_round_has_begun_once_one_of_its_first_writers_published_a_roster() -> None:
    # (a peer still settling before the round then begins too: policy.py)
    key, view = "grad/0/init", _ids(40)
    dht = _Dht()
    reader = Rosters(dht, view[-1], "run")  # type: ignore[arg-type]
    assert not await reader.published(key, view)
    stranger = next(p for p in _ids(5000, start=100) if writers(key, [*view, p])[0] == p)
    await Rosters(dht, stranger, "run").agree(key, [*view, stranger], wait=0.0)  # type: ignore[arg-type]
    assert not await reader.published(key, view)  # one outside our view does not start it
    fifth = writers(key, view, 5)[-1]  # may not write (only the first 3 do), but counts if it did
    await dht.store(f"run/roster/{key}", encode(_ids(30, start=9000)), 0.0, sub_key=fifth)
    assert not await reader.published(key, view)  # a roster that does not agree with our view
    await dht.store(f"run/roster/{key}", encode(view), 0.0, sub_key=fifth)
    assert await reader.published(key, view)


def _agreeing(dht: _Dht, key: str) -> Callable[[str, list[str]], Awaitable[tuple[str, ...]]]:
    """`agree(peer, view)`: that peer's roster of the round `key`, taken at once."""
    async def agree(peer: str, view: list[str]) -> tuple[str, ...]:
        return (await Rosters(dht, peer, "run").agree(key, view, wait=0.0))[0]  # type: ignore[arg-type]
    return agree


async def test_peers_that_begin_before_and_after_the_best_ranked_writer_take_one_roster() -> None:
    # the second-ranked writer begins first; peers that begin then take its roster; the
    # best-ranked writer begins later with another view (its own, a few newcomers more): those
    # that begin after it still take the first roster (the best-ranked rule split the round)
    key = "grad/9/abc"
    trainers, newcomers = _ids(60), _ids(4, start=60)
    best, second = writers(key, trainers)[:2]
    dht = _Dht()
    agree = _agreeing(dht, key)

    chosen = [await agree(second, trainers)]
    chosen += [await agree(p, trainers) for p in trainers[:20] if p not in (best, second)]
    chosen.append(await agree(best, [*trainers, *newcomers]))
    chosen += [await agree(p, [*trainers, *newcomers]) for p in trainers[20:] if p not in (best, second)]
    assert set(chosen) == {tuple(sorted(trainers))}


@pytest.mark.parametrize("judged_by_all", [True, False])
async def test_peers_that_settled_different_parts_of_one_view_take_one_roster(
        judged_by_all: bool) -> None:
    # a run's first round: trainers that began together saw each other arrive at different
    # moments, so the parts of their views old enough to publish (settled) differ: the k-th
    # has settled k+1 of the 12; the best-ranked writer, all. Judged by all they see, every
    # peer takes its roster; judged by their settled parts, the peers that settled few take
    # none of it, publish their own and lay out other grids (a 12-trainer run never stepped)
    key = "grad/0/start"
    trainers = _ids(12)
    best = writers(key, trainers)[0]
    order = [best, *(p for p in trainers if p != best)]
    dht = _Dht()
    chosen = []
    for k, peer in enumerate(order):
        drawn = trainers if peer == best else order[1:k + 1]
        chosen.append((await Rosters(dht, peer, "run").agree(  # type: ignore[arg-type]
            key, drawn, wait=0.0, seen=trainers if judged_by_all else ()))[0])
    assert (set(chosen) == {tuple(sorted(trainers))}) is judged_by_all


async def test_a_writer_ranked_low_in_the_view_does_not_publish_what_it_settled_first() -> None:
    # a first round: the 6th of 12 by rank settled 7 of them (itself among its first three)
    # and began first. Admitted by the rank in what it settled, it published those 7; a peer
    # that had settled few took them, one that had settled all took the best writer's 12
    key = "grad/0/start"
    trainers = _ids(12)
    ranked = writers(key, trainers, 12)
    low = ranked[5]
    settled = [low, *ranked[6:12]]  # 7, the low writer first among them by rank
    assert low in writers(key, settled) and low not in writers(key, trainers, 5)
    assert not publishes(key, low, trainers, settled)
    assert publishes(key, ranked[0], trainers, trainers)
    dht = _Dht()
    chosen = [(await Rosters(dht, low, "run").agree(  # type: ignore[arg-type]
        key, settled, wait=0.0, seen=trainers))[0]]
    for peer, drawn in [(ranked[0], trainers), (ranked[6], settled),
                        (ranked[11], [ranked[11], ranked[10]]),
                        *((p, trainers) for p in ranked[1:11] if p != ranked[6])]:
        chosen.append((await Rosters(dht, peer, "run").agree(  # type: ignore[arg-type]
            key, drawn, wait=0.0, seen=trainers))[0])
    assert set(chosen[1:]) == {tuple(sorted(trainers))}
    assert set(dht.values["run/roster/" + key]) <= set(writers(key, trainers, 5))


async def test_a_roster_dated_in_the_future_holds_a_reader_no_longer_than_its_wait_and_a_settle() -> None:
    # a writer's clock far ahead, or a hostile writer among the first ranks, dates its roster
    # an hour on: the reader took it only once it was SETTLE old, and slept for the hour
    key, view = "grad/3/abc", _ids(12)
    dht = _Dht()
    hostile = writers(key, view)[0]
    dht.values["run/roster/" + key] = {hostile: _Entry(encode(view), timebase.now() + 3600 + TTL)}
    reader = next(p for p in view if p not in writers(key, view, 5))
    started = timebase.monotonic()
    roster, _ = await Rosters(dht, reader, "run").agree(key, view, wait=0.5)  # type: ignore[arg-type]
    assert roster == tuple(sorted(view))
    assert timebase.monotonic() - started <= 0.5 + SETTLE + 0.01


async def test_a_peer_says_it_is_on_its_way_while_it_agrees_on_the_grid_rounds_roster() -> None:
    # (matchmaking's coming_under: a slice-mate that began sooner waits for it as its leader
    # instead of averaging alone after one window)
    key, trainers = "grad/2/abc", _ids(40)
    me = trainers[-1]
    averager = _Averager(me, 16)
    seen: list[list[str]] = []

    class WatchedDht(_Dht):
        async def get(self, dht_key: str, *, timeout: float | None = None) -> _Record | None:
            seen.append(list(averager.coming_prefixes))
            return await super().get(dht_key, timeout=timeout)

    rounds = NetworkRounds(averager, "run", WatchedDht())  # type: ignore[arg-type]
    await rounds.average(np.zeros(8, np.float32), key, weight=1.0, expected=40, role="trainer",
                         peers=tuple(p for p in trainers if p != me), cells=tuple(trainers))
    assert seen and all(prefixes == ["run/grad/2/abc/"] for prefixes in seen), seen
    assert averager.coming_prefixes == [] and averager.stages  # over once its stages began



async def test_a_writer_whose_clock_runs_behind_does_not_take_later_readers_off_the_first_roster() -> None:
    # the second-ranked writer publishes first; the best-ranked one begins 2 s later with its
    # clock 3 s behind: had it published, its roster would have been signed a second before the
    # first, and peers that began after it would have laid out another grid than those before
    key = "grad/4/abc"
    trainers, newcomers = _ids(40), _ids(2, start=40)
    best, second = writers(key, trainers)[:2]
    dht = _Dht()
    agree = _agreeing(dht, key)

    chosen = [await agree(second, trainers)]
    chosen += [await agree(p, trainers) for p in trainers[:10] if p not in (best, second)]
    await asyncio.sleep(2.0)  # (virtual time, this module's marker: no wall time passes)
    inner = timebase.current()

    class _Skewed:
        def now(self) -> float:
            return inner.now() - 3.0

        def monotonic(self) -> float:
            return inner.monotonic()

    token = timebase.use(_Skewed())
    try:
        chosen.append(await agree(best, [*trainers, *newcomers]))
    finally:
        timebase.reset(token)
    chosen += [await agree(p, [*trainers, *newcomers]) for p in trainers[10:] if p not in (best, second)]
    assert set(chosen) == {tuple(sorted(trainers))}
    assert set(dht.values[f"run/roster/{key}"]) == {second}


async def test_a_roster_from_a_slack_rank_writer_does_not_silence_the_first_writers() -> None:
    # readers whose views rank that writer past their first five would not take its roster:
    # they need one of the first writers' to be out too
    key, view = "grad/5/abc", _ids(30)
    dht = _Dht()
    fourth = writers(key, view, 5)[3]
    dht.values[f"run/roster/{key}"] = {fourth: _Entry(encode(view), timebase.now() + TTL - 5)}
    best = writers(key, view)[0]
    await Rosters(dht, best, "run").agree(key, view, wait=0.0)  # type: ignore[arg-type]
    assert set(dht.values[f"run/roster/{key}"]) == {fourth, best}


async def test_readers_take_the_helpers_the_rosters_writer_saw() -> None:
    # the grid's stages depend on how many helpers it seats (grid.py), and a reader that does
    # not see a newcomer yet would lay out fewer: every reader takes the writer's counts
    key, view = "grad/7/abc", _ids(12)
    dht = _Dht()
    best = writers(key, view)[0]
    newcomers = tuple(_ids(4, start=100))
    assert await Rosters(dht, best, "run").agree(  # type: ignore[arg-type]
        key, view, wait=0.0, helpers=(newcomers, 1)) == (tuple(sorted(view)), (newcomers, 1))
    reader = next(p for p in view if p not in writers(key, view, 5))
    assert await Rosters(dht, reader, "run").agree(  # type: ignore[arg-type]
        key, view, wait=0.0, helpers=(newcomers[:3], 0)) == (tuple(sorted(view)), (newcomers, 1))
