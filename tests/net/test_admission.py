"""Fair slots (admission.py), as a transport's handshake slots use them: caps in total and per
source, and when all are held, a source holding fewer takes over the oldest slot, older than
`evict_after`, of a source holding more."""

from __future__ import annotations

import heapq
import random

import pytest

from dedloc.daemon.net.admission import Admission, FairSlots


def _fill(slots: FairSlots[str], now: float, *held: tuple[str, str | None]) -> None:
    for key, source in held:
        assert slots.admit(source, now).admitted
        slots.add(key, source, now)


def test_slots_are_given_until_the_total_and_the_per_source_caps() -> None:
    slots: FairSlots[str] = FairSlots(total=4, per_source=2, evict_after=2.0)
    _fill(slots, 0.0, ("a1", "A"), ("a2", "A"))
    assert slots.admit("A", 0.0) == Admission(False, refused="per_source")
    assert slots.admit("B", 0.0) == Admission(True)
    assert slots.admit(None, 0.0) == Admission(True)  # a source that is not limited
    slots.remove("a1")
    assert slots.admit("A", 0.0) == Admission(True)
    assert len(slots) == 1 and slots.held_by("A") == 1


def test_when_full_the_oldest_slot_of_the_source_holding_most_is_taken_over() -> None:
    slots: FairSlots[str] = FairSlots(total=4, per_source=3, evict_after=2.0)
    _fill(slots, 0.0, ("b1", "B"))
    _fill(slots, 1.0, ("a1", "A"), ("a2", "A"), ("b2", "B"))
    # tied at 2: B's oldest slot is older than A's
    assert slots.admit("C", 5.0) == Admission(True, evict="b1")
    slots.remove("b1")
    slots.add("c1", "C", 5.0)
    assert slots.admit("C", 5.0) == Admission(True, evict="a1")  # A holds 2, C 1
    # a source holding as many as the most takes nothing from anyone
    assert slots.admit("A", 5.0) == Admission(False, refused="full")
    # an unlimited source counts as holding none
    assert slots.admit(None, 5.0) == Admission(True, evict="a1")


def test_a_handshake_younger_than_evict_after_is_not_taken_over() -> None:
    slots: FairSlots[str] = FairSlots(total=3, per_source=3, evict_after=2.0)
    _fill(slots, 0.0, ("a1", "A"))
    _fill(slots, 1.5, ("a2", "A"), ("b1", "B"))
    assert slots.admit("C", 1.9) == Admission(False, refused="full")  # all under 2 s old
    assert slots.admit("C", 2.0) == Admission(True, evict="a1")
    slots.remove("a1")
    slots.add("c1", "C", 2.0)
    # A's remaining slot is young: B (as old, but holding as many as C would) is not a victim
    assert slots.admit("D", 3.0) == Admission(False, refused="full")
    assert slots.admit("D", 3.5) == Admission(True, evict="a2")


def test_unlimited_sources_fill_slots_but_are_never_taken_over() -> None:
    slots: FairSlots[str] = FairSlots(total=3, per_source=3, evict_after=0.0)
    _fill(slots, 0.0, ("l1", None), ("l2", None), ("x1", "X"))
    assert slots.admit("Y", 0.0) == Admission(True, evict="x1")
    slots.remove("x1")
    slots.add("y1", "Y", 0.0)
    slots.remove("l1")
    slots.add("l3", None, 0.0)
    assert slots.admit(None, 0.0) == Admission(True, evict="y1")
    slots.remove("y1")
    slots.add("l4", None, 0.0)
    assert slots.admit(None, 0.0) == Admission(False, refused="full")  # only the unlimited hold slots
    assert slots.admit("W", 0.0) == Admission(False, refused="full")


def test_a_slot_is_freed_once_and_an_evicted_handshake_ending_later_changes_nothing() -> None:
    slots: FairSlots[str] = FairSlots(total=2, per_source=2, evict_after=0.0)
    _fill(slots, 0.0, ("a1", "A"), ("a2", "A"))
    slots.remove("a1")  # evicted: its slot is freed at once
    slots.add("b1", "B", 0.0)
    slots.remove("a1")  # ... and its task ends later: nothing more is freed
    assert len(slots) == 2 and slots.held_by("A") == 1 and slots.held_by("B") == 1
    with pytest.raises(ValueError, match="holds a slot already"):
        slots.add("b1", "B", 0.0)
    assert sorted(slots) == ["a2", "b1"]


def _attack(addresses: int, handshake: float, evict_after: float) -> bool:
    """Silent connections from `addresses` sources fill 64 slots; an honest newcomer's handshake
    takes `handshake` seconds; the attacker reconnects every address whose slot was taken over,
    at once. Whether the newcomer's handshake completes."""
    slots: FairSlots[str] = FairSlots(total=64, per_source=16, evict_after=evict_after)
    now, serial = 0.0, 0
    while len(slots) < 64:
        for i in range(addresses):
            if slots.admit(f"X{i}", now).admitted and len(slots) < 64:
                slots.add(f"x{serial}", f"X{i}", now)
                serial += 1
    now = 10 * evict_after
    decision = slots.admit("honest", now)
    if not decision.admitted:
        return False
    if decision.evict is not None:
        slots.remove(decision.evict)
    slots.add("h", "honest", now)
    # the attacker floods from every address, over and over, during the whole handshake
    for _ in range(50):
        for i in range(addresses):
            decision = slots.admit(f"X{i}", now)
            if decision.admitted:
                if decision.evict is not None:
                    slots.remove(decision.evict)
                slots.add(f"x{serial}", f"X{i}", now)
                serial += 1
        now += handshake / 50
    return "h" in list(slots)


@pytest.mark.parametrize("addresses", [4, 16, 64, 256])
def test_an_attacker_flooding_from_many_addresses_does_not_drop_a_newcomers_handshake(
        addresses: int) -> None:
    """However many addresses an attacker floods from, the newcomer takes the oldest slot and
    keeps it for as long as its handshake takes, up to `evict_after` (2 s by default)."""
    assert _attack(addresses, handshake=1.9, evict_after=2.0)


def test_with_no_age_floor_an_attacker_with_as_many_addresses_as_slots_drops_the_newcomer() -> None:
    """Why the floor: with none, 64 addresses reconnecting at once push the newcomer out."""
    assert not _attack(64, handshake=0.1, evict_after=0.0)


def _completed_per_second(arrivals: float, evict_after: float, seconds: float = 40.0) -> float:
    """Honest connections, each from an address of its own, arriving `arrivals` a second at
    random; each handshake takes 1 s. Handshakes completed per second."""
    rng = random.Random(1)
    slots: FairSlots[int] = FairSlots(total=64, per_source=16, evict_after=evict_after)
    now, ending, done, serial = 0.0, [], 0, 0
    while now < seconds:
        now += rng.expovariate(arrivals)
        while ending and ending[0][0] <= now:
            _, key = heapq.heappop(ending)
            if key in list(slots):  # (not evicted meanwhile)
                slots.remove(key)
                done += 1
        decision = slots.admit(f"S{serial}", now)
        if decision.admitted:
            if decision.evict is not None:
                slots.remove(decision.evict)
            slots.add(serial, f"S{serial}", now)
            heapq.heappush(ending, (now + 1.0, serial))
        serial += 1
    return done / seconds


@pytest.mark.parametrize("arrivals", [60, 100, 200])
def test_more_honest_connections_than_slots_still_complete_as_many_handshakes_as_slots_allow(
        arrivals: int) -> None:
    """A bootstrap node after a restart: no handshake is taken over before it could complete,
    so the slots keep completing about 64 a second (with no floor: almost none at 100/s)."""
    assert _completed_per_second(arrivals, evict_after=2.0) > 55
    if arrivals >= 100:
        assert _completed_per_second(arrivals, evict_after=0.0) < 10


def test_slots_need_room_for_one_and_a_floor_of_at_least_zero() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FairSlots(total=0, per_source=1, evict_after=2.0)
    with pytest.raises(ValueError, match="evict_after"):
        FairSlots(total=1, per_source=1, evict_after=float("nan"))
