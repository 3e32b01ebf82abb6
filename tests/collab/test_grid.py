"""Grid rounds (collab/grid.py): the layout, and the stages composed over an in-memory rendezvous
that averages each slice exactly (so what is tested is the composition, in milliseconds)."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest

from dedloc.daemon.averaging.report import AveragingReport
from dedloc.daemon.collab.errors import RoundSatOut
from dedloc.daemon.collab.grid import GridLayout, GridRounds, grid_layout


def _ids(n: int) -> list[str]:
    return [f"{i:04x}" + "ab" * 30 for i in range(n)]


@pytest.mark.parametrize(("n", "group", "expected"), [
    (8, 8, None), (8, 9, None), (9, 8, (3, 2)), (256, 32, (16, 2)), (256, 16, (16, 2)),
    (257, 16, (7, 3)), (1000, 8, (6, 4)), (5000, 8, None),
])
def test_the_grid_is_the_smallest_that_fits(n: int, group: int, expected: tuple[int, int] | None) -> None:
    layout = grid_layout("k", _ids(n), group)
    assert (None if layout is None else (layout.side, layout.dimensions)) == expected


def test_a_full_grid_meets_every_trainer_once_per_stage() -> None:
    trainers = _ids(256)
    layout = grid_layout("grad/3/abc", trainers, 32)
    assert layout is not None and len(set(layout.cells.values())) == 256
    for s in range(layout.dimensions):
        slices = {layout.stages(p)[s] for p in trainers}
        assert len(slices) == 16 and all(len(stage.peers) == 16 for stage in slices)
        # every trainer is in exactly one slice per stage, and its own
        assert Counter(p for stage in slices for p in stage.peers) == Counter(trainers)
        assert all(p in layout.stages(p, "grad/3/abc")[s].peers for p in trainers)


def test_every_peer_computes_the_same_grid_and_another_key_another_one() -> None:
    trainers = _ids(100)
    a = grid_layout("grad/1/x", trainers, 16)
    b = grid_layout("grad/1/x", list(reversed(trainers)), 16)
    c = grid_layout("grad/2/y", trainers, 16)
    assert a is not None and b is not None and c is not None
    assert a.cells == b.cells and a.cells != c.cells


def test_aux_peers_reduce_for_one_slice_per_stage_and_those_trainers_expect_them() -> None:
    trainers, aux = _ids(64), [f"aux{i}" for i in range(4)]
    layout = grid_layout("k", trainers, 12, aux)
    assert layout is not None
    for s in range(layout.dimensions):
        for a in aux:
            stage = layout.stages(a, "k")[s]
            assert a in stage.peers
            for t in (p for p in stage.peers if p in layout.cells):
                assert layout.stages(t, "k")[s] == stage


def test_the_cells_go_to_the_last_rounds_members_and_newcomers_help() -> None:
    trainers = _ids(40)
    old, new = trainers[:36], trainers[36:]
    views = [GridRounds(p, 8).layout("k", [t for t in trainers if t != p], (), "trainer", old)
             for p in (old[0], old[17], new[0])]
    assert all(v is not None for v in views)
    assert views[0] == views[1] == views[2]  # every peer lays out the same grid
    assert set(views[0].cells) == set(old) and set(views[0].helpers) == set(new)
    # a peer that does not see one newcomer yet still puts every old member in the same cell
    partial = GridRounds(old[3], 8).layout("k", [t for t in trainers if t not in (old[3], new[1])],
                                           (), "trainer", old)
    assert partial is not None and partial.cells == views[0].cells


def test_last_rounds_members_too_few_to_seat_the_others_give_every_trainer_a_cell() -> None:
    # 3 of 8 trainers stepped (in groups of 4, with an aux peer): no grid on 3 cells has room
    # for 5 trainers and the aux peer as helpers, and a one-group round of 4 never holds the
    # majority of 8 a step needs (a simulated run stalled there with thousands of failed rounds)
    trainers, aux = _ids(8), ["ff" * 31]
    stepped = trainers[:3]
    views = [GridRounds(p, 4).layout("k", [t for t in trainers if t != p], aux, "trainer", stepped)
             for p in (trainers[0], trainers[5])]
    views.append(GridRounds(aux[0], 4).layout("k", trainers, (), "aux", stepped))
    assert all(v is not None for v in views)
    assert views[0] == views[1] == views[2]
    assert set(views[0].cells) == set(trainers) and set(views[0].helpers) == set(aux)
    # nor may the aux peers fit beside the cells (4 trainers and an aux peer, groups of 2): the
    # trainers average on a grid of their own and the aux peer sits it out
    small = [GridRounds(p, 2).layout("k", [t for t in trainers[:4] if t != p], aux, "trainer")
             for p in trainers[:4]]
    small.append(GridRounds(aux[0], 2).layout("k", trainers[:4], (), "aux"))
    assert all(v is not None and v == small[0] for v in small)
    assert set(small[0].cells) == set(trainers[:4]) and not small[0].helpers
    assert all(stage is None for stage in small[0].stages(aux[0], "k"))


async def test_an_aux_peer_the_grid_has_no_room_for_sits_the_round_out() -> None:
    # (4 trainers and an aux peer in groups of 2: its tries counted as failed rounds, about one
    # every 2 s, where it had nothing to do)
    trainers, aux = _ids(4), "ff" * 31
    rounds = GridRounds(aux, 2)
    layout = rounds.layout("k", trainers, (), "aux")
    assert layout is not None

    async def never(*args: object) -> AveragingReport | None:
        raise AssertionError("an aux peer that sits the round out runs no stage")
    with pytest.raises(RoundSatOut, match="no slice of grid round k has room"):
        await rounds.average(layout, np.zeros(6, np.float32), "k", weight=0.0, role="aux",
                             stage_round=never)


def test_a_rosters_cells_stay_the_rosters_when_the_others_do_not_fit_as_helpers() -> None:
    # after a roster (the same list everywhere) a grid laid out on each peer's own view would
    # differ between views of 8 and 9 trainers: the roster's trainers keep the cells, the others
    # (and the aux peer) sit the round out where the roster's writer said nothing of helpers
    trainers, aux = _ids(9), ["ff" * 31]
    roster = trainers[:5]  # (more than half of the trainers seen: it can make a step alone)

    def views(said: tuple[int, int] | None) -> list[GridLayout | None]:
        out = [GridRounds(p, 4).layout("k", [t for t in trainers[:8] if t != p], aux, "trainer",
                                       roster, roster=True, helpers_said=said)
               for p in trainers[:2]]
        return out + [GridRounds(p, 4).layout("k", [t for t in trainers if t != p], aux,
                                              "trainer", roster, roster=True, helpers_said=said)
                      for p in (trainers[2], trainers[8])]

    silent = views(None)
    assert all(v is not None and v == silent[0] for v in silent)
    assert set(silent[0].cells) == set(roster) and not silent[0].helpers
    assert all(stage is None for stage in silent[0].stages(trainers[8], "k"))
    # a roster of half the trainers seen or fewer could make no step on its own cells
    few = GridRounds(trainers[0], 4).layout("k", trainers[1:8], aux, "trainer", trainers[:3],
                                            roster=True)
    assert few is not None and set(few.cells) == set(trainers[:8])


def test_helpers_a_roster_names_get_a_slice_in_every_stage_on_every_view() -> None:
    # 8 cells and 4 newcomers in groups of 4: no grid has room for twice the helpers' mean, so
    # the newcomers sat every round out (a churn of 8 trainers: 90 failed rounds, a third of
    # the live trainers out of a round). The roster's writer saw the 4 newcomers and the aux
    # peer: every view lays out that grid and places them alike, the view that sees only 3 of
    # them and the one that sees a fifth newcomer too; no slice holds more than the group
    trainers, aux = _ids(13), ["ff" * 31]
    roster, newcomers, late = trainers[:8], trainers[8:12], trainers[12]
    said = (tuple(newcomers), 1)

    def layout(peer: str, view: list[str]) -> GridLayout | None:
        return GridRounds(peer, 4).layout("k", [t for t in view if t != peer], aux, "trainer",
                                          roster, roster=True, helpers_said=said)

    views = [(p, trainers[:12]) for p in trainers[:12]]
    views += [(trainers[0], trainers[:11]), (trainers[0], trainers), (late, trainers)]
    layouts = [layout(p, view) for p, view in views]
    assert all(v is not None for v in layouts)
    assert len({(v.dimensions, tuple(sorted(v.cells.items()))) for v in layouts}) == 1  # type: ignore[union-attr]
    for s in range(layouts[0].dimensions):  # type: ignore[union-attr]
        for newcomer in newcomers:  # placed alike on every view that sees it
            stages = [v.stages(newcomer, "k")[s] for v, (_, view) in zip(layouts, views,
                                                                         strict=True)
                      if newcomer in view]  # type: ignore[union-attr]
            assert None not in stages and len({st.label for st in stages}) == 1, stages  # type: ignore[union-attr]
        # one it does not see takes its room, but no stage expects it
        unseen = layouts[12].stages(trainers[11], "k")[s]  # type: ignore[union-attr]
        assert unseen is None
        assert all(trainers[11] not in (st.peers if st else ()) for p in trainers[:8]
                   for st in [layouts[12].stages(p, "k")[s]])  # type: ignore[union-attr]
        # each peer goes where its own view puts it: no slice gets more than a group
        arrivals: Counter[str] = Counter()
        for peer, view in [*((p, layouts[0]) for p in [*roster, *newcomers]), (late, layouts[-1])]:
            stage = view.stages(peer, "k")[s]  # type: ignore[union-attr]
            if stage is not None:
                assert len(stage.peers) <= 4, stage
                arrivals[stage.label] += 1
        assert max(arrivals.values()) <= 4, arrivals
    # the same without a list from the roster: the newcomers have no room and sit out
    silent = GridRounds(trainers[0], 4).layout("k", trainers[1:12], aux, "trainer", roster,
                                               roster=True)
    assert silent is not None and not silent.helpers


def test_a_list_by_which_the_cells_would_fit_one_group_is_ignored() -> None:
    # a hostile writer's list of no helpers beside 11 cells in groups of 16 would make the
    # round one group of 11 expected where 20 trainers come: the peer's own view counts then
    trainers, aux = _ids(20), ["ff" * 31]
    roster = trainers[:11]
    own = GridRounds(trainers[0], 16).layout("k", trainers[1:], aux, "trainer", roster,
                                             roster=True)
    hostile = GridRounds(trainers[0], 16).layout("k", trainers[1:], aux, "trainer", roster,
                                                 roster=True, helpers_said=((), 0))
    assert own is not None and hostile == own


async def test_a_trainer_the_grid_has_no_room_for_sits_the_round_out() -> None:
    # a newcomer beyond the slices' room: not a failed round to try again at once (it was, every
    # half second, until the head moved), but RoundSatOut: the engine waits and keeps its samples
    trainers, aux = _ids(9), ["ff" * 31]
    roster = trainers[:5]
    rounds = GridRounds(trainers[8], 4)
    layout = rounds.layout("k", trainers[:8], aux, "trainer", roster, roster=True)
    assert layout is not None and trainers[8] not in layout.cells

    async def never(*args: object) -> AveragingReport | None:
        raise AssertionError("a trainer that sits the round out runs no stage")
    with pytest.raises(RoundSatOut, match="has room for this trainer"):
        await rounds.average(layout, np.ones(6, np.float32), "k", weight=1.0, role="trainer",
                             stage_round=never)


@dataclass
class Rendezvous:
    """Averages each stage key's vectors exactly once every expected peer has arrived, and, as
    the all-reduce does, gives the mean back to those that sent (weight > 0) only."""

    arrivals: dict[str, list[tuple[str, np.ndarray, float, int, asyncio.Future[AveragingReport]]]] = \
        field(default_factory=dict)
    missing: set[str] = field(default_factory=set)  # these peers never come

    def stage_round(self, peer: str, key: str):
        async def run(vector, label, weight, represents, max_represents, peers, min_trainers, leaders):
            slot = self.arrivals.setdefault(f"{key}/{label}", [])
            done: asyncio.Future[AveragingReport] = asyncio.get_running_loop().create_future()
            slot.append((peer, vector, weight, represents, done))
            expected = {peer, *peers} - self.missing
            if {p for p, *_ in slot} == expected:
                senders = [(v, w, r) for _, v, w, r, _ in slot if w > 0]
                total = sum(w for _, w, _ in senders)
                mean = sum(v * w for v, w, _ in senders) / total
                members = tuple(sorted(p for p, *_ in slot))
                for _, v, w, _, future in slot:
                    if w > 0:
                        v[:] = mean
                    future.set_result(AveragingReport(
                        key=label, group_id=label, members=members, trainers=len(members),
                        senders=len(senders), part=(0, 0), shares=(), seconds=0.0,
                        matchmaking_seconds=0.0, allreduce_seconds=0.0, bytes_sent=0,
                        bytes_received=0, failed_parts=(), senders_excluded={},
                        senders_rejected={}, finished_at=0.0, weight=total,
                        represented=sum(min(r, max_represents) for *_, r in senders)))
            return await done
        return run


async def _grid_round(n: int, group: int, key: str = "grad/0/x", missing: int = 0,
                      newcomers: int = 0, aux: int = 0):
    """A grid round of n trainers (the last `newcomers` of them hold no cell: they help, and
    bring their weight) and `aux` aux peers, every stage averaged exactly by a rendezvous."""
    rng = np.random.default_rng(5)
    trainers = _ids(n)
    cells = trainers[: n - newcomers]
    aux_ids = [f"aux{i}" for i in range(aux)]
    vectors = {p: rng.normal(size=6).astype(np.float32) for p in trainers}
    inputs = {p: v.copy() for p, v in vectors.items()}
    weights = {p: float(rng.integers(1, 50)) for p in trainers}
    rendezvous = Rendezvous(missing=set(trainers[:missing]))
    present = trainers[missing:]
    exact = sum(vectors[p] * weights[p] for p in present) / sum(weights[p] for p in present)

    async def one(peer: str, role: str = "trainer") -> AveragingReport | None:
        rounds = GridRounds(peer, group)
        layout = rounds.layout(key, [p for p in trainers if p != peer], [a for a in aux_ids if a != peer],
                               role, cells if newcomers else ())  # type: ignore[arg-type]
        assert layout is not None
        vector = vectors[peer] if role == "trainer" else np.zeros(6, np.float32)
        return await rounds.average(layout, vector, key, weight=weights.get(peer, 0.0),
                                    role=role,  # type: ignore[arg-type]
                                    stage_round=rendezvous.stage_round(peer, key))
    reports = await asyncio.gather(*(one(p) for p in present), *(one(a, "aux") for a in aux_ids))
    reports = reports[: len(present)]
    spread = float(np.mean([np.linalg.norm(inputs[p] - exact) for p in present]))
    return reports, {p: vectors[p] for p in present}, exact, spread


async def test_a_full_grid_round_is_the_exact_weighted_mean_and_counts_every_trainer() -> None:
    reports, vectors, exact, _ = await _grid_round(64, 8)  # 8 x 8
    for report, vector in zip(reports, vectors.values(), strict=True):
        assert report is not None and report.stages == 2
        assert report.trainers == report.represented == 64
        assert report.group_id == "grid/grad/0/x"  # one name: one lineage after the step
        np.testing.assert_allclose(vector, exact, rtol=1e-5)


@pytest.mark.parametrize(("n", "group"), [(70, 9), (241, 16), (26, 6), (257, 16), (200, 8)])
async def test_a_partly_filled_grid_is_the_exact_weighted_mean_too(n: int, group: int) -> None:
    # 70: 9 x 9 with 11 cells empty; 241: one trainer in the last row of 16; 257 and 200: 3 stages
    reports, vectors, exact, _ = await _grid_round(n, group)
    for report, vector in zip(reports, vectors.values(), strict=True):
        assert report is not None and report.trainers == report.represented == n
        # exact up to float32 rounding (relative to the vector's largest element)
        np.testing.assert_allclose(vector, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


@pytest.mark.parametrize(("n", "group"), [(70, 9), (241, 16), (26, 6), (257, 16), (200, 8)])
def test_stand_ins_for_empty_cells_are_few_and_spread(n: int, group: int) -> None:
    layout = grid_layout("k", _ids(n), group)
    assert layout is not None
    loads = Counter(p for p in layout.cells for duties in layout.duties(p, "k") for _ in duties)
    assert max(loads.values(), default=0) <= 2  # no trainer carries the empty end of the grid
    for s in range(layout.dimensions):  # a slice holds one trainer per block, none twice
        for trainer in layout.cells:
            peers = layout.stages(trainer, "k")[s].peers
            assert len(peers) == len(set(peers)) <= layout.side


async def test_a_trainer_that_never_comes_is_left_out_of_its_slices_only() -> None:
    async with asyncio.timeout(60):  # a safety net: the rendezvous itself never waits
        reports, vectors, exact, spread = await _grid_round(64, 8, missing=1)
    counts = sorted(r.trainers for r in reports if r is not None)
    assert counts[-1] == 63 and counts[0] >= 56
    # the slices that met the missing trainer's row average without it: close to the mean
    for vector in vectors.values():
        assert np.linalg.norm(vector - exact) < 0.2 * spread


async def test_newcomers_without_a_cell_count_once_and_the_mean_stays_exact() -> None:
    # 40 trainers of which 6 newcomers to the head help (weight in their first stage only),
    # and 3 aux peers: every trainer ends with the exact weighted mean of all 40 (a helper that
    # went into its later stages with weight 0 got no mean back there and kept its block's)
    reports, vectors, exact, _ = await _grid_round(40, 8, newcomers=6, aux=3)
    for report, vector in zip(reports, vectors.values(), strict=True):
        assert report is not None
        np.testing.assert_allclose(vector, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


@pytest.mark.parametrize(("n", "group", "helpers"), [(73, 4, 3), (576, 25, 5), (1002, 33, 8), (64, 12, 4)])
def test_no_slice_holds_more_than_a_group_with_its_helpers(n: int, group: int, helpers: int) -> None:
    for k in range(20):
        key = f"grad/{k}/x"
        layout = grid_layout(key, _ids(n), group, [f"aux{i}" for i in range(helpers)])
        assert layout is not None
        for s in range(layout.dimensions):
            sizes = Counter()
            for peer in [*layout.cells, *layout.helpers]:
                stage = layout.stages(peer, key)[s]
                if stage is not None:
                    assert len(stage.peers) <= group
                    sizes[stage.label] = len(stage.peers)
            # every helper is placed somewhere while there is room
            placed = sum(1 for h in layout.helpers if layout.stages(h, key)[s] is not None)
            room = sum(group - len(m) for m in layout._slices(s).values())
            assert placed == min(helpers, room)


def test_a_members_claim_to_stand_for_many_trainers_counts_for_what_its_stage_allows() -> None:
    from dedloc.daemon.averaging.group import Group, Member

    layout = grid_layout("k", _ids(256), 32)
    assert layout is not None
    assert [layout.max_represents(s) for s in range(layout.dimensions)] == [1, 16]
    honest = [Member(p, "trainer", 10.0, 1e6, 1e6, represents=16) for p in _ids(15)]
    liar = Member("f" * 64, "trainer", 10.0, 1e6, 1e6, represents=60_000)
    group = Group("g", "k", (*honest, liar), 1, ((0, 1),) + ((1, 1),) * 15, 1, "none", 0.0)
    assert group.averaged((), layout.max_represents(1)) == (160.0, 256)  # not 60 240
    assert group.averaged({liar.peer_id}, layout.max_represents(1)) == (150.0, 240)
    assert group.averaged((), 1) == (160.0, 16)  # a one-group round: one trainer each
