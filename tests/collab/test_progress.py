"""Pure tests of progress reports and the run's progress estimate (see also test_policy.py)."""

from __future__ import annotations

import dataclasses

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedloc.daemon.collab.estimate import GlobalProgress, estimate_global, next_report_delay
from dedloc.daemon.collab.progress import (
    MAX_EPOCH,
    MAX_OVERHEAD,
    MAX_SAMPLES,
    MAX_SAMPLES_PER_SECOND,
    InvalidProgress,
    PeerProgress,
    reports_from_sub_keys,
)

NOW = 1_700_000_000.0
STALE = 30.0


def report(peer_id: str = "peer-a", *, epoch: int = 5, samples: int = 0, sps: float = 0.0,
           age: float = 0.0, ttl: float = 60.0, role: str = "trainer", total: int = 0,
           overhead: float | None = None) -> PeerProgress:
    return PeerProgress(peer_id=peer_id, epoch=epoch, samples_accumulated=samples,
                        samples_per_second=sps, time=NOW - age, expiration=NOW - age + ttl,
                        role=role, total_samples=total, step_overhead=overhead)  # type: ignore[arg-type]


def estimate(reports: list[PeerProgress], target: int = 1000, own: PeerProgress | None = None,
             now: float = NOW) -> GlobalProgress:
    return estimate_global(reports, target_batch_size=target, now=now, own=own, stale_after=STALE)


progress_reports = st.builds(
    PeerProgress,
    peer_id=st.text(min_size=1, max_size=64),
    epoch=st.integers(0, MAX_EPOCH),
    samples_accumulated=st.integers(0, MAX_SAMPLES),
    samples_per_second=st.floats(0, MAX_SAMPLES_PER_SECOND),
    time=st.floats(0, 2e9),
    expiration=st.floats(2e9, 3e9),
    role=st.sampled_from(["trainer", "aux"]),
    total_samples=st.integers(0, MAX_SAMPLES),
    served=st.integers(0, MAX_SAMPLES),
)


# --- records -------------------------------------------------------------------------------------

@given(progress_reports)
def test_round_trip(progress: PeerProgress) -> None:
    assert PeerProgress.from_bytes(progress.to_bytes(), progress.peer_id) == progress


def test_integral_floats_are_normalised() -> None:
    progress = PeerProgress("p", 1, 2, 3, 4, 5)  # type: ignore[arg-type]
    assert isinstance(progress.samples_per_second, float)
    assert PeerProgress.from_bytes(progress.to_bytes(), "p") == progress


def _payload(**changes: object) -> bytes:
    payload = orjson.loads(report().to_bytes())
    payload.update(changes)
    return orjson.dumps(payload)


@pytest.mark.parametrize(("field", "value"), [
    ("epoch", -1),
    ("epoch", 1.5),
    ("epoch", "5"),
    ("epoch", True),
    ("epoch", MAX_EPOCH + 1),
    ("samples_accumulated", -3),
    ("samples_accumulated", None),
    ("samples_accumulated", MAX_SAMPLES + 1),
    ("samples_per_second", -0.5),
    ("samples_per_second", 2e9),
    ("samples_per_second", "fast"),
    ("time", -1.0),
    ("time", 1e300),
    ("expiration", NOW - 10),  # before the report's time
    ("role", "boss"),
    ("total_samples", -1),
    ("total_samples", [1]),
    ("served", -1),
    ("served", 2.5),
    ("served", MAX_SAMPLES + 1),
    ("peer_id", "someone-else"),
])
def test_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidProgress) as info:
        PeerProgress.from_bytes(_payload(**{field: value}), "peer-a")
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("field", ["samples_per_second", "time", "expiration"])
def test_nan_and_infinity_refused(field: str) -> None:
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InvalidProgress, match=field):
            dataclasses.replace(report(), **{field: bad})


@pytest.mark.parametrize("field", ["epoch", "time", "role", "peer_id"])
def test_missing_field(field: str) -> None:
    payload = orjson.loads(report().to_bytes())
    del payload[field]
    with pytest.raises(InvalidProgress, match=field):
        PeerProgress.from_bytes(orjson.dumps(payload), "peer-a")


@pytest.mark.parametrize("data", [b"", b"not json", b"[1, 2]", b"{" + b" " * 5000 + b"}",
                                  b'{"epoch": NaN}'])
def test_malformed_report(data: bytes) -> None:
    with pytest.raises(InvalidProgress, match="report"):
        PeerProgress.from_bytes(data, "peer-a")


def test_unknown_fields_are_ignored() -> None:
    assert PeerProgress.from_bytes(_payload(future_field=1), "peer-a") == report()


def test_reports_from_sub_keys_keeps_the_good_ones() -> None:
    good = report("a")
    reports, rejected = reports_from_sub_keys({
        "a": good.to_bytes(), "b": good.to_bytes(), "c": b"\xff"})
    assert reports == [good]
    assert set(rejected) == {"b", "c"}
    assert "peer_id" in rejected["b"]


# --- step overhead (optional field) --------------------------------------------------------------

@given(progress_reports, st.one_of(st.none(), st.floats(0, MAX_OVERHEAD)))
def test_round_trip_with_step_overhead(progress: PeerProgress, overhead: float | None) -> None:
    progress = dataclasses.replace(progress, step_overhead=overhead)
    decoded = PeerProgress.from_bytes(progress.to_bytes(), progress.peer_id)
    assert decoded == progress
    assert decoded.step_overhead == overhead


def test_step_overhead_is_encoded_and_normalised() -> None:
    progress = report(overhead=2)
    assert isinstance(progress.step_overhead, float)
    assert orjson.loads(progress.to_bytes())["step_overhead"] == 2.0
    assert orjson.loads(report().to_bytes())["step_overhead"] is None
    assert PeerProgress.from_bytes(report(overhead=0.25).to_bytes(), "peer-a").step_overhead == 0.25
    assert report(overhead=0.0).step_overhead == 0.0
    assert report(overhead=MAX_OVERHEAD).step_overhead == MAX_OVERHEAD


def test_a_report_of_an_older_peer_without_step_overhead_decodes() -> None:
    payload = orjson.loads(report().to_bytes())
    del payload["step_overhead"]
    decoded = PeerProgress.from_bytes(orjson.dumps(payload), "peer-a")
    assert decoded.step_overhead is None
    assert decoded == report()


@pytest.mark.parametrize("value", [-0.001, -1, float("nan"), float("inf"), MAX_OVERHEAD * 1.001,
                                   1e300, True, "1.5", [1.0], {}])
def test_bad_step_overhead_refused(value: object) -> None:
    with pytest.raises(InvalidProgress) as info:
        dataclasses.replace(report(), step_overhead=value)
    assert info.value.field == "step_overhead"
    assert "step_overhead" in str(info.value)


@pytest.mark.parametrize("value", [-1, MAX_OVERHEAD + 1, "slow", True, [1]])
def test_bad_step_overhead_refused_when_decoding(value: object) -> None:
    with pytest.raises(InvalidProgress) as info:
        PeerProgress.from_bytes(_payload(step_overhead=value), "peer-a")
    assert info.value.field == "step_overhead"
    rejected = reports_from_sub_keys({"peer-a": _payload(step_overhead=value)})[1]
    assert "step_overhead" in rejected["peer-a"]


def test_trainers_at_epoch_counts_only_live_trainers_at_the_runs_epoch() -> None:
    progress = estimate([
        report("a", epoch=5),
        report("b", epoch=5),
        report("c", epoch=5),
        report("behind", epoch=4),
        report("ahead", epoch=6),
        report("aux", epoch=5, role="aux"),
        report("stale", epoch=5, age=STALE + 1, ttl=1000),
        report("expired", epoch=5, age=2, ttl=1),
    ])
    assert progress.epoch == 5
    assert progress.live_trainers == 5
    assert progress.trainers_at_epoch == 3


def test_trainers_at_epoch_counts_own_and_each_peer_once() -> None:
    own = report("me", epoch=5, age=STALE * 2, ttl=1)
    progress = estimate([report("a", epoch=5, age=3), report("a", epoch=5, age=1),
                         report("me", epoch=4)], own=own)
    assert progress.trainers_at_epoch == 2


def test_trainers_at_epoch_without_trainers() -> None:
    assert estimate([]).trainers_at_epoch == 0
    assert estimate([report("x", role="aux", epoch=3)]).trainers_at_epoch == 0  # aux never count


def test_step_overhead_is_the_worst_at_the_runs_epoch() -> None:
    progress = estimate([
        report("a", epoch=5, overhead=0.5),
        report("b", epoch=5, overhead=2.5),
        report("c", epoch=5),  # an older peer: no overhead reported
        report("behind", epoch=4, overhead=100.0),
        report("ahead", epoch=6, overhead=200.0),
        report("aux", epoch=5, role="aux", overhead=300.0),
        report("stale", epoch=5, age=STALE + 1, ttl=1000, overhead=400.0),
    ])
    assert progress.epoch == 5
    assert progress.step_overhead == 2.5


def test_step_overhead_none_when_nobody_at_the_epoch_reports_one() -> None:
    assert estimate([]).step_overhead is None
    assert estimate([report("a"), report("b")]).step_overhead is None
    progress = estimate([report("a", epoch=5), report("b", epoch=5), report("c", epoch=4, overhead=1.0)])
    assert progress.step_overhead is None
    assert estimate([report("a", overhead=0.0)]).step_overhead == 0.0  # zero is a report


def test_own_step_overhead_counts() -> None:
    own = report("me", epoch=5, overhead=7.0)
    progress = estimate([report("a", epoch=5, overhead=1.0), report("me", epoch=5, overhead=99.0)],
                        own=own)
    assert progress.step_overhead == 7.0
    assert progress.trainers_at_epoch == 2


def test_global_progress_defaults_for_the_new_fields() -> None:
    progress = GlobalProgress(epoch=0, samples_accumulated=0, target_batch_size=1, live_trainers=0,
                              live_aux=0, samples_per_second=0.0, eta_seconds=None, ready=False,
                              now=NOW)
    assert progress.trainers_at_epoch == 0
    assert progress.step_overhead is None


# --- liveness ------------------------------------------------------------------------------------

def test_stale_expired_and_future_reports_dropped() -> None:
    progress = estimate([
        report("fresh", samples=10),
        report("stale", samples=100, age=STALE + 1, ttl=1000),
        report("expired", samples=100, age=1, ttl=1),
        report("future", samples=100, age=-(STALE + 1)),
    ])
    assert progress.live_trainers == 1
    assert progress.samples_accumulated == 10
    assert set(progress.contributions) == {"fresh"}


def test_latest_report_per_peer_wins() -> None:
    progress = estimate([report("a", samples=50, age=1), report("a", samples=10, age=5),
                         report("b", samples=1)])
    assert progress.live_trainers == 2
    assert progress.samples_accumulated == 51


def test_own_replaces_the_dht_copy_and_is_never_stale() -> None:
    own = report("me", samples=300, age=STALE * 2, ttl=1)
    progress = estimate([report("me", samples=10), report("b", samples=5)], own=own)
    assert progress.live_trainers == 2
    assert progress.samples_accumulated == 305


# --- samples -------------------------------------------------------------------------------------

def test_extrapolation_by_throughput() -> None:
    progress = estimate([report("a", samples=100, sps=10.0, age=4.0),
                         report("b", samples=50, sps=5.0, age=2.0)])
    assert progress.samples_accumulated == 100 + 40 + 50 + 10
    assert progress.samples_per_second == 15.0
    assert progress.eta_seconds == pytest.approx((1000 - 200) / 15.0)


def test_extrapolation_is_capped_at_a_batch_per_peer() -> None:
    progress = estimate([report("a", samples=0, sps=MAX_SAMPLES_PER_SECOND, age=1.0),
                         report("b", samples=MAX_SAMPLES)], target=1000)
    assert progress.samples_accumulated == 2000
    assert progress.ready


def test_clock_skew_does_not_extrapolate_backwards() -> None:
    progress = estimate([report("a", samples=100, sps=10.0, age=-5.0)])
    assert progress.samples_accumulated == 100


def test_peer_behind_the_epoch_is_ignored_for_the_sum() -> None:
    progress = estimate([report("a", epoch=5, samples=100, sps=1.0),
                         report("b", epoch=5, samples=100, sps=1.0),
                         report("old", epoch=4, samples=700, sps=50.0, total=9)])
    assert progress.epoch == 5
    assert progress.samples_accumulated == 200
    assert progress.samples_per_second == 2.0
    assert progress.live_trainers == 3
    assert progress.contributions["old"] == 9


def test_a_single_liar_does_not_move_the_epoch() -> None:
    honest = [report(f"h{i}", epoch=5, samples=100) for i in range(3)]
    progress = estimate([*honest, report("liar", epoch=10**6, samples=10**6)])
    assert progress.epoch == 5
    assert progress.samples_accumulated == 300
    assert not progress.ready


@given(honest=st.integers(2, 8), epoch=st.integers(0, 100), lie=st.integers(0, MAX_EPOCH))
def test_any_single_liar_is_outvoted(honest: int, epoch: int, lie: int) -> None:
    """(Among trainers that have trained: fresh peers are no evidence, see test_policy.py.)"""
    reports = [report(f"h{i}", epoch=epoch, samples=1) for i in range(honest)]
    assert estimate([*reports, report("liar", epoch=lie)]).epoch == epoch


def test_two_peers_confirm_a_new_epoch() -> None:
    progress = estimate([report("a", epoch=6), report("b", epoch=6), report("c", epoch=5)])
    assert progress.epoch == 6
    assert estimate([report("a", epoch=6)]).epoch == 6  # alone, a peer is the run


def test_the_highest_epoch_is_reported_apart_from_the_confirmed_one() -> None:
    """Two trainers: either confirms an epoch, so a peer coming back follows the one that trained
    on; three: one peer ahead is unconfirmed, and `highest_epoch` says where it is."""
    own = report("back", epoch=4, samples=0)
    ahead = report("ahead", epoch=21, samples=100)
    progress = estimate([ahead], own=own)
    assert (progress.epoch, progress.highest_epoch, progress.trainers_at_epoch) == (21, 21, 1)
    progress = estimate([ahead, report("other", epoch=4)], own=own)
    assert (progress.epoch, progress.highest_epoch, progress.trainers_at_epoch) == (4, 21, 2)
    assert estimate([report("a", epoch=6), report("b", epoch=6)]).highest_epoch == 6
    assert estimate([report("x", role="aux", epoch=9)]).highest_epoch == 9  # no trainer: the epoch
    assert estimate([]).highest_epoch == 0


def test_aux_peers_counted_apart() -> None:
    progress = estimate([report("t", samples=100, sps=10.0),
                         report("x", role="aux", samples=500, sps=100.0, epoch=9, total=3)])
    assert (progress.live_trainers, progress.live_aux) == (1, 1)
    assert progress.samples_accumulated == 100
    assert progress.samples_per_second == 10.0
    assert progress.epoch == 5
    assert progress.contributions == {"t": 0, "x": 3}


def test_no_peers() -> None:
    progress = estimate([])
    assert (progress.epoch, progress.samples_accumulated, progress.live_trainers) == (0, 0, 0)
    assert progress.eta_seconds is None
    assert not progress.ready
    assert estimate([report("x", role="aux", epoch=4)]).epoch == 4


def test_ready_exactly_at_the_target() -> None:
    below = estimate([report("a", samples=600), report("b", samples=399)])
    assert not below.ready
    assert below.eta_seconds is None
    at = estimate([report("a", samples=600), report("b", samples=400)])
    assert at.ready
    assert at.eta_seconds == 0.0
    assert at.remaining == 0


@given(a=st.integers(0, 2000), b=st.integers(0, 2000), sps=st.floats(0.1, 1e4))
def test_eta_monotonic_in_samples(a: int, b: int, sps: float) -> None:
    low, high = sorted((a, b))
    eta_low = estimate([report("p", samples=low, sps=sps)]).eta_seconds
    eta_high = estimate([report("p", samples=high, sps=sps)]).eta_seconds
    assert eta_low is not None and eta_high is not None
    assert eta_high <= eta_low


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"target_batch_size": 0}, "target_batch_size"),
    ({"stale_after": 0.0}, "stale_after"),
    ({"now": float("nan")}, "now"),
])
def test_estimate_arguments_checked(kwargs: dict[str, object], name: str) -> None:
    arguments: dict[str, object] = {"target_batch_size": 10, "now": NOW, "stale_after": STALE}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=name):
        estimate_global([], **arguments)  # type: ignore[arg-type]


# --- scheduling ----------------------------------------------------------------------------------

@given(samples=st.integers(0, 1500), sps=st.floats(0, 1e5), own=st.floats(0, 1e5),
       low=st.floats(0, 10), span=st.floats(0, 100))
def test_next_report_delay_within_bounds(samples: int, sps: float, own: float, low: float,
                                         span: float) -> None:
    progress = estimate([report("p", samples=samples, sps=sps)])
    delay = next_report_delay(progress, own, min_delay=low, max_delay=low + span)
    assert low <= delay <= low + span


def test_next_report_delay_shrinks_near_the_target() -> None:
    def delay(samples: int) -> float:
        return next_report_delay(estimate([report("p", samples=samples, sps=10.0)]), 10.0,
                                 min_delay=0.5, max_delay=30.0)

    far, nearer, near, ready = delay(0), delay(700), delay(990), delay(1000)
    assert far == 30.0
    assert nearer == pytest.approx(15.0)  # half of the 30 s left
    assert near == pytest.approx(0.5)
    assert ready == 0.5
    assert far >= nearer >= near >= ready


def test_next_report_delay_uses_own_throughput_and_waits_without_any() -> None:
    idle = estimate([report("p", samples=0)])
    assert next_report_delay(idle, 0.0, min_delay=1.0, max_delay=60.0) == 60.0
    assert next_report_delay(idle, 100.0, min_delay=1.0, max_delay=60.0) == 5.0


def test_next_report_delay_arguments_checked() -> None:
    with pytest.raises(ValueError, match="min_delay"):
        next_report_delay(estimate([]), 1.0, min_delay=5.0, max_delay=1.0)
