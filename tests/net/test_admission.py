"""Handshake slots (admission.py): caps in total and per source, and when all are held, a source
holding fewer takes over the oldest slot of the source holding the most."""

from __future__ import annotations

import pytest

from dedloc.daemon.net.admission import Admission, HandshakeSlots


def _fill(slots: HandshakeSlots[str], *held: tuple[str, str | None]) -> None:
    for key, source in held:
        assert slots.admit(source).admitted
        slots.add(key, source)


def test_slots_are_given_until_the_total_and_the_per_source_caps() -> None:
    slots: HandshakeSlots[str] = HandshakeSlots(total=4, per_source=2)
    _fill(slots, ("a1", "A"), ("a2", "A"))
    assert slots.admit("A") == Admission(False, refused="per_source")
    assert slots.admit("B") == Admission(True)
    assert slots.admit(None) == Admission(True)  # a source that is not limited
    slots.remove("a1")
    assert slots.admit("A") == Admission(True)
    assert len(slots) == 1 and slots.held_by("A") == 1


def test_when_full_the_oldest_slot_of_the_source_holding_most_is_taken_over() -> None:
    slots: HandshakeSlots[str] = HandshakeSlots(total=4, per_source=3)
    _fill(slots, ("b1", "B"), ("a1", "A"), ("a2", "A"), ("b2", "B"))
    # tied at 2: B's oldest slot is older than A's
    assert slots.admit("C") == Admission(True, evict="b1")
    slots.remove("b1")
    slots.add("c1", "C")
    assert slots.admit("C") == Admission(True, evict="a1")  # A holds 2, C 1
    # a source holding as many as the most takes nothing from anyone
    assert slots.admit("A") == Admission(False, refused="full")
    # an unlimited source counts as holding none
    assert slots.admit(None) == Admission(True, evict="a1")


def test_unlimited_sources_fill_slots_but_are_never_taken_over() -> None:
    slots: HandshakeSlots[str] = HandshakeSlots(total=3, per_source=3)
    _fill(slots, ("l1", None), ("l2", None), ("x1", "X"))
    assert slots.admit("Y") == Admission(True, evict="x1")
    slots.remove("x1")
    slots.add("y1", "Y")
    assert slots.admit("Z") == Admission(True, evict="y1")
    slots.remove("y1")
    slots.remove("l1")
    slots.add("l3", None)
    slots.add("z1", "Z")
    assert slots.admit(None) == Admission(True, evict="z1")
    slots.remove("z1")
    slots.add("l4", None)
    assert slots.admit(None) == Admission(False, refused="full")  # only the unlimited hold slots
    assert slots.admit("W") == Admission(False, refused="full")


def test_a_slot_is_freed_once_and_an_evicted_handshake_ending_later_changes_nothing() -> None:
    slots: HandshakeSlots[str] = HandshakeSlots(total=2, per_source=2)
    _fill(slots, ("a1", "A"), ("a2", "A"))
    slots.remove("a1")  # evicted: its slot is freed at once
    slots.add("b1", "B")
    slots.remove("a1")  # ... and its task ends later: nothing more is freed
    assert len(slots) == 2 and slots.held_by("A") == 1 and slots.held_by("B") == 1
    with pytest.raises(ValueError, match="holds a slot already"):
        slots.add("b1", "B")
    assert sorted(slots) == ["a2", "b1"]


def test_an_attacker_with_as_many_sources_as_slots_cannot_keep_a_newcomer_out() -> None:
    """64 attacker addresses each holding one slot: each newcomer from a source holding none
    takes the oldest; the attacker's addresses, all holding one, take nothing from each other."""
    slots: HandshakeSlots[str] = HandshakeSlots(total=64, per_source=16)
    _fill(slots, *((f"x{i}", f"X{i}") for i in range(64)))
    for i in range(64):
        assert slots.admit(f"X{i}") == Admission(False, refused="full")
    decision = slots.admit("honest")
    assert decision == Admission(True, evict="x0")
    slots.remove("x0")
    slots.add("h", "honest")
    # the evicted address comes back: it takes the oldest attacker slot, not the newcomer's
    assert slots.admit("X0") == Admission(True, evict="x1")


def test_slots_need_room_for_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        HandshakeSlots(total=0, per_source=1)
