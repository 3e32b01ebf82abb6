"""A finished run's final state (final_state.py): written once, served from its file over the
simulated network (the real transport and state server, virtual time) with the run's final
head, reported on the board while it is served, and gone (a farewell, the file removed) when
it is closed or its time is up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from dedloc.daemon import timebase
from dedloc.daemon.collab.engine import RunProgress
from dedloc.daemon.collab.final_state import REPORT_EVERY, FinalState, FinishedDonor
from dedloc.daemon.collab.lineage import initial_lineage
from dedloc.daemon.collab.ports import DownloadedState
from dedloc.daemon.collab.progress import PeerProgress
from dedloc.daemon.collab.state_sync import StateSharing, download_state
from dedloc.daemon.identity import Identity
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import VirtualClockLoop, run_virtual
from dedloc.sim.network import SimNetwork, SimTransport
from dedloc.sim.trainer import ArrayBuffer

KEY = "collab/run/0123456789abcdef"
L0 = initial_lineage("run")
EPOCH = 30


class RecordingBoard:
    """The run's board as the donor sees it: what it published and its farewells."""

    def __init__(self) -> None:
        self.published: list[PeerProgress] = []
        self.left: list[PeerProgress] = []

    async def publish(self, report: PeerProgress) -> bool:
        self.published.append(report)
        return True

    async def read(self) -> tuple[list[PeerProgress], dict[str, float]]:
        return [], {}

    async def leave(self, report: PeerProgress) -> None:
        self.left.append(report)


def _exported(values: np.ndarray) -> DownloadedState:
    buffer = ArrayBuffer(values.size)
    buffer.array[:] = values
    return DownloadedState(buffer, values.size, {"layout": "flat", "names": ["w"]}, EPOCH, L0,
                           ("peer-a", "peer-b"))


def test_the_final_state_is_served_from_its_file_with_its_head(tmp_path: Path) -> None:
    values = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    final = FinalState.write(tmp_path / "run", _exported(values))
    assert final.values_path.stat().st_size == values.nbytes
    assert not list((tmp_path / "run").glob("*.partial"))

    async def main() -> None:
        timebase.use(SkewedClock(asyncio.get_running_loop()))
        network = SimNetwork()
        serving = SimTransport.start_on(network, network.add_host(), Identity.generate())
        asking = SimTransport.start_on(network, network.add_host(), Identity.generate())
        board, progress = RecordingBoard(), RunProgress(samples=12345)
        donor = FinishedDonor(final, peer_id=serving.peer_id, board=board, progress=progress,
                              started_at=timebase.now())
        StateSharing(serving, lambda key: donor if key == KEY else None)
        asking.learn_addresses(serving.peer_id, serving.listen_addresses())
        donor.start()
        await asyncio.sleep(3 * REPORT_EVERY + 1)
        state = await download_state(asking, serving.peer_id, KEY, allocate=ArrayBuffer)
        np.testing.assert_array_equal(state.buffer.array, values)
        assert (state.epoch, state.lineage, state.group) == (EPOCH, L0, ("peer-a", "peer-b"))
        assert state.meta == {"layout": "flat", "names": ["w"]}
        assert progress.states_served == 1
        # a donor at the final head, report after report, that trains nothing
        assert len(board.published) >= 3 and not board.left
        for report in board.published:
            assert (report.peer_id, report.epoch, report.lineage, report.role) == \
                (serving.peer_id, EPOCH, L0, "trainer")
            assert (report.samples_accumulated, report.samples_per_second, report.planned,
                    report.total_samples) == (0, 0.0, 0, 12345)
        await donor.close()
        assert not donor.holds_state and len(board.left) == 1
        assert not final.values_path.exists()
        with pytest.raises(Exception, match="no active run"):  # nothing served any more
            await download_state(asking, serving.peer_id, KEY, allocate=ArrayBuffer)
        await asking.close()
        await serving.close()

    run_virtual(main())


def test_it_stops_serving_when_its_time_is_up(tmp_path: Path) -> None:
    final = FinalState.write(tmp_path, _exported(np.ones(10, dtype=np.float32)))

    async def main() -> None:
        # (the sleeps below are virtual: no wall-clock wait, nothing a loaded machine delays)
        assert isinstance(asyncio.get_running_loop(), VirtualClockLoop)
        timebase.use(SkewedClock(asyncio.get_running_loop()))
        board = RecordingBoard()
        donor = FinishedDonor(final, peer_id="me", board=board, progress=RunProgress(),
                              started_at=timebase.now(), serve_seconds=95.0)
        donor.start()
        await asyncio.sleep(94.0)  # (virtual time: run_virtual, no wall-clock wait)
        assert donor.holds_state and len(board.published) == 10  # (at 0, 10, ..., 90 s)
        await asyncio.sleep(2.0)
        assert not donor.holds_state and len(board.left) == 1
        assert not final.values_path.exists()
        await donor.close()  # (twice is fine)
        assert len(board.left) == 1

    run_virtual(main())


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    class Unwritable:
        @property
        def array(self) -> np.ndarray:
            raise OSError("No space left on device")

        def close(self) -> None:
            """(nothing to let go of)"""

    state = DownloadedState(Unwritable(), 10, {}, EPOCH, L0)
    with pytest.raises(OSError, match="No space"):
        FinalState.write(tmp_path, state)
    assert list(tmp_path.iterdir()) == []
