"""TEST ONLY: make this daemon a bad sender, to test the other peers' defences end to end.

    DEDLOC_TESTING=1 DEDLOC_TEST_CORRUPT_PARTS=nan,short,scale=1e6 dedlocd ...

makes every chunk this daemon sends to another reducer bad, round k (counted from 0 in this
process) in the k-th way of the list, cycling:
    nan, inf   a non-finite value in the chunk (none: the float itself; fp16: its bit pattern;
               quantile8: a level; uint8: the meta's minimum, topk: the meta's largest
               magnitude, both of which JSON carries as null);
    short      the payload 4 bytes short of the chunk's length;
    scale=F    the chunk multiplied by F before encoding (finite, well formed: an absurd norm).
Its own part, its averages and everything else stay honest. The local API cannot do this: a local
NaN is the caller's error (averaging.average refuses it), so a bad sender is simulated below it.

DEDLOC_TEST_WRONG_ANSWERS=zeros (or scale=F) makes this daemon a reducer that answers every
chunk wrong while its account (accounts.py) stays honest; =forge answers zeros and forges its
account to agree, misstating one other sender's contribution (the one of largest weight); with
=forge_own it misstates its own contribution instead; =forge_skip forges as =forge does and
sends the sender it misstates a skip in place of the answer (withheld.py); =equivocate sends each member an
account in which that member's entry is true and another sender's is forged (answers.py).

DEDLOC_TEST_CLAIMED_BANDWIDTH=F makes this daemon claim F bytes/s of upload and download in every
round, whatever it measured (claims.py bounds what others believe of it).

DEDLOC_TEST_CLAIMED_WEIGHT=F makes this daemon claim an averaging weight of F in every round it
sends in (weight > 0), whatever it accumulated, and weight its contribution by F (as if it had
computed F samples) as far as the round's weight budget lets it (Group.bounded_weights), ignoring
the bound its run sets on its own claim (the leaders and followers of honest peers enforce that
bound on it: matchmaking_methods.py).

DEDLOC_TEST_EQUIVOCATING_LEADER=1 makes this daemon, as the leader of a group of three or more,
send its first follower another group under the same id (its own weight halved), signed as the
true one is (leading.py), so that the members hold two groups of one id.

Each switch is refused unless DEDLOC_TESTING=1 is set as well (logged as an error, and ignored):
a production daemon never corrupts anything because of a stray variable.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
import structlog

from ..identity import Identity
from .accounts import Entry
from .codec import Buffer, Codec, Meta
from .group import Group
from .signatures import round_name, sign_group

log = structlog.get_logger(__name__)

SWITCH = "DEDLOC_TEST_CORRUPT_PARTS"
TESTING = "DEDLOC_TESTING"
MODES = ("nan", "inf", "short", "scale")


class SenderCorruption:
    def __init__(self, modes: list[str]) -> None:
        for mode in modes:
            name, _, argument = mode.partition("=")
            if name not in MODES or (name == "scale") != bool(argument):
                raise ValueError(f"unknown corruption {mode!r} (known: nan, inf, short, scale=F)")
            if argument and not math.isfinite(float(argument)):
                raise ValueError(f"the scale of {mode!r} must be finite")
        self.modes = modes
        self._rounds = itertools.cycle(modes)

    def next_round(self) -> str:
        """The way the next round's chunks are corrupted."""
        return next(self._rounds)

    @staticmethod
    def encode(mode: str, codec: Codec, values: np.ndarray) -> tuple[Buffer, Meta]:
        """The bad payload and meta of one chunk."""
        name, _, argument = mode.partition("=")
        if name == "scale":
            return codec.encode(np.multiply(values, np.float32(float(argument))))
        payload, meta = codec.encode(values)
        if name == "short":
            return bytes(memoryview(payload).cast("B")[:-4]), meta
        bad = float("nan") if name == "nan" else float("inf")
        if codec.name == "none":
            copy = np.array(values, dtype=np.float32)
            copy[0] = bad
            return copy.tobytes(), meta
        if codec.name == "uint8":
            return payload, {**meta, "lo": bad}
        if codec.name == "topk":
            return payload, {**meta, "hi": bad}
        raw = bytearray(memoryview(payload).cast("B"))
        if codec.name == "fp16":
            raw[0:2] = np.array([bad], np.float16).tobytes()
        else:  # quantile8: the first level
            raw[0:4] = np.array([bad], np.float32).tobytes()
        return raw, meta


ANSWERS_SWITCH = "DEDLOC_TEST_WRONG_ANSWERS"
ANSWER_MODES = ("zeros", "scale", "forge", "forge_own", "forge_skip", "equivocate")


def wrong_answer(mode: str, average: np.ndarray) -> None:
    """TEST ONLY: turn a reducer's average (in place) into a wrong one: `zeros` or `forge`, or
    `scale=F` (the average times F)."""
    name, _, argument = mode.partition("=")
    if name in ("zeros", "forge", "forge_own", "forge_skip", "equivocate"):
        average[...] = 0.0
    else:
        np.multiply(average, np.float32(float(argument)), out=average)


def forged_entries(entries: Sequence[Entry], scales: Sequence[float], reducer: int,
                   answer_projections: Sequence[float], *, own: bool = False,
                   spare: int | None = None) -> list[Entry]:
    """TEST ONLY (`forge`, `forge_own`, `equivocate`): the account with one sender's
    projections (the reducer's own, or the other sender's of largest weight but `spare`)
    rewritten so that the weighted mean of the entries (scaled as the rule scales them) is the
    answer's projection in every segment: every check passes but that sender's own (or, for its
    own, an audit: audits.py)."""
    others = [k for k, e in enumerate(entries)
              if (e.sender == reducer) == own and e.sender != spare]
    if not others:
        return list(entries)
    victim = max(others, key=lambda k: entries[k].weight)
    total = sum(e.weight for e in entries)
    projections = []
    for segment, answer in enumerate(answer_projections):
        rest = sum(e.weight * s * e.projections[segment]
                   for k, (e, s) in enumerate(zip(entries, scales, strict=True)) if k != victim)
        projections.append((answer * total - rest) / (entries[victim].weight * scales[victim]))
    forged = list(entries)
    forged[victim] = dataclasses.replace(entries[victim], projections=tuple(projections))
    return forged


def answers_from_environment(env: Mapping[str, str] = os.environ) -> str | None:
    """DEDLOC_TEST_WRONG_ANSWERS=zeros or scale=F (with DEDLOC_TESTING=1): this daemon, as a
    reducer, answers every chunk wrong (its own vector gets the wrong values too)."""
    wanted = env.get(ANSWERS_SWITCH, "").strip()
    if not wanted:
        return None
    if env.get(TESTING) != "1":
        log.error("test_switch_refused", switch=ANSWERS_SWITCH,
                  reason=f"it is for tests only and {TESTING}=1 is not set: ignored")
        return None
    name, _, argument = wanted.partition("=")
    if name not in ANSWER_MODES or (name == "scale") != bool(argument) \
            or (argument and not math.isfinite(float(argument))):
        raise ValueError(f"unknown wrong answer {wanted!r} (known: zeros, scale=F, forge, "
                         "forge_own, forge_skip, equivocate)")
    log.warning("test_wrong_answers_enabled", switch=ANSWERS_SWITCH, mode=wanted)
    return wanted


def from_environment(env: Mapping[str, str] = os.environ) -> SenderCorruption | None:
    """The corruption the environment asks for, if tests are running; else None."""
    wanted = env.get(SWITCH, "").strip()
    if not wanted:
        return None
    if env.get(TESTING) != "1":
        log.error("test_switch_refused", switch=SWITCH,
                  reason=f"it is for tests only and {TESTING}=1 is not set: ignored")
        return None
    corruption = SenderCorruption([m.strip() for m in wanted.split(",") if m.strip()])
    log.warning("test_corruption_enabled", switch=SWITCH, modes=corruption.modes)
    return corruption


CLAIM_SWITCH = "DEDLOC_TEST_CLAIMED_BANDWIDTH"


def claimed_bandwidth_from_environment(env: Mapping[str, str] = os.environ) -> float | None:
    """DEDLOC_TEST_CLAIMED_BANDWIDTH=F (with DEDLOC_TESTING=1): the bytes/s this daemon claims
    for both directions in every round, in place of its measurements; else None."""
    wanted = env.get(CLAIM_SWITCH, "").strip()
    if not wanted:
        return None
    if env.get(TESTING) != "1":
        log.error("test_switch_refused", switch=CLAIM_SWITCH,
                  reason=f"it is for tests only and {TESTING}=1 is not set: ignored")
        return None
    claim = float(wanted)
    if not (math.isfinite(claim) and claim > 0):
        raise ValueError(f"{CLAIM_SWITCH} must be a positive number of bytes/s, not {wanted!r}")
    log.warning("test_claimed_bandwidth_enabled", switch=CLAIM_SWITCH, claim=claim)
    return claim


WEIGHT_SWITCH = "DEDLOC_TEST_CLAIMED_WEIGHT"


def claimed_weight_from_environment(env: Mapping[str, str] = os.environ) -> float | None:
    """DEDLOC_TEST_CLAIMED_WEIGHT=F (with DEDLOC_TESTING=1): the averaging weight this daemon
    claims, and weights its contribution by, in every round it sends in; else None."""
    wanted = env.get(WEIGHT_SWITCH, "").strip()
    if not wanted:
        return None
    if env.get(TESTING) != "1":
        log.error("test_switch_refused", switch=WEIGHT_SWITCH,
                  reason=f"it is for tests only and {TESTING}=1 is not set: ignored")
        return None
    claim = float(wanted)
    if not (math.isfinite(claim) and claim > 0):
        raise ValueError(f"{WEIGHT_SWITCH} must be a positive weight, not {wanted!r}")
    log.warning("test_claimed_weight_enabled", switch=WEIGHT_SWITCH, claim=claim)
    return claim


LEADER_SWITCH = "DEDLOC_TEST_EQUIVOCATING_LEADER"


def equivocating_leader_from_environment(env: Mapping[str, str] = os.environ) -> bool:
    """DEDLOC_TEST_EQUIVOCATING_LEADER=1 (with DEDLOC_TESTING=1): this daemon, leading, tells
    one follower another group than the others (`equivocal_group`)."""
    if env.get(LEADER_SWITCH, "").strip() != "1":
        return False
    if env.get(TESTING) != "1":
        log.error("test_switch_refused", switch=LEADER_SWITCH,
                  reason=f"it is for tests only and {TESTING}=1 is not set: ignored")
        return False
    log.warning("test_equivocating_leader_enabled", switch=LEADER_SWITCH)
    return True


def equivocal_group(group: Group, identity: Identity | None) -> Group:
    """TEST ONLY: `group` under the same id with its leader's own weight halved, signed by the
    leader (`identity`) as the true one is: what an equivocating leader tells one follower."""
    members = tuple(dataclasses.replace(m, weight=m.weight / 2) if m.peer_id == group.leader
                    else m for m in group.members)
    other = dataclasses.replace(group, members=members)
    return dataclasses.replace(other, leader_signature="" if identity is None else sign_group(
        identity, other.group_id, round_name(other)))
