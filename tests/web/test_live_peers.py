"""What the dashboard's peer tables read from a run's progress: each live peer and since when it
takes part (`started_at` in its reports; older peers that do not send it are still read)."""

from __future__ import annotations

import orjson
import pytest

from dedloc.daemon.collab.estimate import estimate_global
from dedloc.daemon.collab.progress import InvalidProgress, PeerProgress

NOW = 1_700_000_000.0


def report(peer_id: str, *, started_at: float | None, epoch: int = 3, total: int = 0,
           left: bool = False, role: str = "trainer") -> PeerProgress:
    return PeerProgress(peer_id, epoch, 10, 5.0, NOW - 1, NOW + 30, role, total,  # type: ignore[arg-type]
                        left=left, started_at=started_at)


def test_started_at_round_trips_and_older_reports_have_none() -> None:
    progress = report("a", started_at=NOW - 100)
    assert PeerProgress.from_bytes(progress.to_bytes(), "a") == progress
    older = orjson.loads(progress.to_bytes())
    del older["started_at"]
    assert PeerProgress.from_bytes(orjson.dumps(older), "a").started_at is None


@pytest.mark.parametrize("started_at", [-1.0, float("nan"), 1e12, NOW + 5])
def test_a_bad_started_at_is_refused(started_at: float) -> None:
    with pytest.raises(InvalidProgress) as caught:
        report("a", started_at=started_at)
    assert caught.value.field == "started_at"


def test_live_peers_lists_every_live_peer_with_its_start() -> None:
    reports = [report("b", started_at=NOW - 50, total=300), report("c", started_at=None, total=7),
               report("gone", started_at=NOW - 9, left=True),
               report("x", started_at=NOW - 20, role="aux", epoch=2)]
    own = report("a", started_at=NOW - 100, total=500)
    progress = estimate_global(reports, target_batch_size=64, now=NOW, own=own, stale_after=30.0)
    assert [p["peer_id"] for p in progress.live_peers] == ["a", "b", "c", "x"]
    assert progress.live_peers[0] == {"peer_id": "a", "role": "trainer", "epoch": 3, "lineage": None,
                                      "samples_per_second": 5.0, "total_samples": 500,
                                      "started_at": NOW - 100, "reported_at": NOW - 1,
                                      "stepped": False}
    assert progress.live_peers[2]["started_at"] is None
    assert progress.live_peers[3]["role"] == "aux"
    assert progress.contributions == {"a": 500, "b": 300, "c": 7, "x": 0}
