"""State donations over the simulated network (the real transport, links and streams, on virtual
time): a donor mid-round serves the state it steps to once the round is over (it used to answer
busy, and in a run of fast rounds the peers behind never caught up), a round that never ends is
waited out only so long, a third asker is told busy, and a malformed header is refused."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from averaging.fake_transport import HandlerTransport

from dedloc.daemon import timebase
from dedloc.daemon.collab import state_sync
from dedloc.daemon.collab.engine import PhaseCell, RunProgress
from dedloc.daemon.collab.errors import DonorBusy, DonorContradicted, StateSyncError
from dedloc.daemon.collab.estimate import Head
from dedloc.daemon.collab.lineage import initial_lineage, next_lineage
from dedloc.daemon.collab.ports import DownloadedState
from dedloc.daemon.collab.state_sync import StateSharing, download_state
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, RequestContext, Stream
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import run_virtual
from dedloc.sim.network import SimNetwork, SimTransport
from dedloc.sim.trainer import ArrayBuffer

KEY = "collab/run/0123456789abcdef"
L0 = initial_lineage("run")


class Donor:
    """What StateSharing needs of an engine (ports.StateDonor): a phase, the state with its
    head."""

    def __init__(self, size: int = 1000) -> None:
        self.phase = PhaseCell("training")
        self.holds_state = True
        self.epoch, self.lineage = 3, L0
        self.values = np.arange(size, dtype=np.float32)
        self.exports = 0
        self.progress = RunProgress()  # (its states_served is published: donors.py)

    async def export_state(self) -> DownloadedState:
        self.exports += 1
        buffer = ArrayBuffer(self.values.size)
        buffer.array[:] = self.values
        return DownloadedState(buffer, self.values.size, {"layout": "flat"}, self.epoch, self.lineage)

    async def step_after(self, seconds: float) -> None:
        """A round that ends after `seconds`, stepping the state."""
        self.phase.set("averaging")
        await asyncio.sleep(seconds)
        self.values += 1
        self.epoch, self.lineage = self.epoch + 1, next_lineage(self.lineage, "group")
        self.phase.set("training")


async def _pair(donor: Any) -> tuple[SimTransport, SimTransport]:
    network = SimNetwork()
    serving = SimTransport.start_on(network, network.add_host(), Identity.generate())
    asking = SimTransport.start_on(network, network.add_host(), Identity.generate())
    StateSharing(serving, lambda key: donor if key == KEY else None)
    asking.learn_addresses(serving.peer_id, serving.listen_addresses())
    return serving, asking


def _answering(header: dict[str, Any]) -> tuple[SimTransport, SimTransport]:
    """A donor that answers every state request with one message of `header` (a liar), and a
    peer that asks it."""
    network = SimNetwork()
    serving = SimTransport.start_on(network, network.add_host(), Identity.generate())
    asking = SimTransport.start_on(network, network.add_host(), Identity.generate())

    async def liar(ctx: RequestContext, stream: Stream) -> None:
        await stream.send(Message(header), timeout=10)
        await stream.close()

    serving.add_stream_handler(state_sync.METHOD, liar)
    asking.learn_addresses(serving.peer_id, serving.listen_addresses())
    return serving, asking


def test_a_donor_mid_round_serves_the_state_it_steps_to() -> None:
    async def main() -> None:
        donor = Donor()
        serving, asking = await _pair(donor)
        round_over = asyncio.create_task(donor.step_after(3.0))
        state = await download_state(asking, serving.peer_id, KEY, allocate=ArrayBuffer)
        await round_over
        assert (state.epoch, state.lineage) == (4, next_lineage(L0, "group"))
        np.testing.assert_array_equal(state.buffer.array, np.arange(1000, dtype=np.float32) + 1)
        assert state.meta == {"layout": "flat"}
        await asking.close()
        await serving.close()

    run_virtual(main())


def test_a_header_behind_or_beside_the_reported_head_is_refused_before_the_state() -> None:
    # a donor that reported (5, another lineage) but holds (3, L0): its own word against it,
    # refused on its header, before a byte of the state is allocated (the whole state came
    # first, and a trainer whose round was forming spent that time on it)
    async def main() -> None:
        donor = Donor()
        serving, asking = await _pair(donor)
        allocated: list[int] = []

        def allocate(numel: int) -> ArrayBuffer:
            allocated.append(numel)
            return ArrayBuffer(numel)

        for reported in (Head(5, L0), Head(3, next_lineage(L0, "elsewhere"))):
            with pytest.raises(DonorContradicted, match="reported the run's head"):
                await download_state(asking, serving.peer_id, KEY, allocate=allocate,
                                     expect=reported)
        assert allocated == []
        # where it moved on past what it reported (a round since), the state is taken
        state = await download_state(asking, serving.peer_id, KEY, allocate=allocate,
                                     expect=Head(2, next_lineage(L0, "earlier")))
        assert (state.epoch, state.lineage) == (3, L0) and allocated == [1000]
        await asking.close()
        await serving.close()

    run_virtual(main())


def test_a_round_that_never_ends_is_waited_out_only_so_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_sync, "ROUND_WAIT_SECONDS", 5.0)

    async def main() -> None:
        donor = Donor()
        donor.phase.set("averaging")
        serving, asking = await _pair(donor)
        with pytest.raises(DonorBusy, match="in an averaging round"):
            await download_state(asking, serving.peer_id, KEY, allocate=ArrayBuffer)
        assert donor.exports == 0
        await asking.close()
        await serving.close()

    run_virtual(main())


@pytest.mark.parametrize("others", [0, 2])
def test_a_third_asker_is_told_busy_and_the_first_two_are_served(others: int) -> None:
    # (`others`: the askers say they have other donors to ask: the third is sent elsewhere, to
    # ask this one again after FULL_RETRY_SECONDS)
    async def main() -> None:
        donor = Donor(size=4 << 20)  # 16 MiB: the streams take a while at 100 Mbit/s
        network = SimNetwork()
        serving = SimTransport.start_on(network, network.add_host(), Identity.generate())
        sharing = StateSharing(serving, lambda key: donor)
        askers = [SimTransport.start_on(network, network.add_host(), Identity.generate())
                  for _ in range(3)]
        for asker in askers:
            asker.learn_addresses(serving.peer_id, serving.listen_addresses())

        async def ask(asker: SimTransport, delay: float) -> DownloadedState | Exception:
            await asyncio.sleep(delay)
            try:
                return await download_state(asker, serving.peer_id, KEY, allocate=ArrayBuffer,
                                            others=others)
            except DonorBusy as exc:
                return exc

        results = await asyncio.gather(*(ask(a, 0.1 * i) for i, a in enumerate(askers)))
        assert [type(r).__name__ for r in results] == ["DownloadedState", "DownloadedState",
                                                       "DonorBusy"]
        for state in results[:2]:
            assert isinstance(state, DownloadedState) and state.numel == 4 << 20
        busy = results[2]
        assert isinstance(busy, DonorBusy) and busy.shed == (others > 0) and sharing.shed == busy.shed
        if others:
            assert busy.retry_after == state_sync.FULL_RETRY_SECONDS
        for transport in (*askers, serving):
            await transport.close()

    run_virtual(main())


@pytest.mark.parametrize("header", [
    {"meta": {}, "numel": -1, "epoch": 1},
    {"meta": {}, "numel": 10, "epoch": -1},
    {"meta": {}, "numel": 10, "epoch": 1, "lineage": "not-a-lineage"},
    {"meta": "x", "numel": 10, "epoch": 1},
    {"meta": {}, "numel": 1 << 40, "epoch": 1},
])
def test_a_malformed_state_header_is_refused(header: dict[str, Any]) -> None:
    async def main() -> None:
        serving, asking = _answering(header)
        with pytest.raises(StateSyncError, match="malformed state header"):
            await download_state(asking, serving.peer_id, KEY, allocate=ArrayBuffer)
        await asking.close()
        await serving.close()

    run_virtual(main())


@pytest.mark.parametrize(("numel", "free", "refusal"), [
    (9_000_000, None, "more than 8999999 elements for this model"),  # past max_numel
    # past /dev/shm: this peer's own limit (LocalStateError: the donor is not blamed for it)
    (1_000_000, 1_000_000, r"does not fit in this machine's free shared memory \(1000000 bytes\)"),
])
def test_a_state_larger_than_the_model_or_the_memory_is_refused_before_allocating(
        numel: int, free: int | None, refusal: str) -> None:
    async def main() -> None:
        network = SimNetwork()
        serving = SimTransport.start_on(network, network.add_host(), Identity.generate())
        asking = SimTransport.start_on(network, network.add_host(), Identity.generate())

        async def inflated(ctx: RequestContext, stream: Stream) -> None:
            await stream.send(Message({"meta": {}, "numel": numel, "epoch": 1}), timeout=10)
            await asyncio.Event().wait()  # and never the state: the receiver must refuse first

        serving.add_stream_handler(state_sync.METHOD, inflated)
        asking.learn_addresses(serving.peer_id, serving.listen_addresses())
        allocated: list[int] = []

        def allocate(n: int) -> ArrayBuffer:
            allocated.append(n)
            return ArrayBuffer(n)

        with pytest.raises(StateSyncError, match=refusal):
            await download_state(asking, serving.peer_id, KEY, allocate=allocate,
                                 max_numel=8_999_999,
                                 free_bytes=lambda: free)
        assert allocated == []
        await asking.close()
        await serving.close()

    run_virtual(main())


def test_a_slow_reader_is_cut_off_and_holds_one_slot_only() -> None:
    """The attacker asks twice at once (one slot per peer: the second is told busy), then reads
    nothing: an honest peer still gets the donor's other slot, and the donor cuts the attacker's
    stream once it is slower than MIN_SERVE_RATE over the state's size (it used to wait 120 s per
    chunk, for ever, while the attacker read a byte now and then)."""
    async def main() -> None:
        donor = Donor(size=16 << 20)  # 64 MiB: far more than the links' buffers hold unread
        network = SimNetwork()
        serving = SimTransport.start_on(network, network.add_host(), Identity.generate())
        sharing = StateSharing(serving, lambda key: donor)
        attacker, honest = (SimTransport.start_on(network, network.add_host(), Identity.generate())
                            for _ in range(2))
        for transport in (attacker, honest):
            transport.learn_addresses(serving.peer_id, serving.listen_addresses())

        streams = [await attacker.open_stream(serving.peer_id, state_sync.METHOD, {"key": KEY},
                                              timeout=15) for _ in range(2)]
        firsts = [await s.receive(timeout=60) for s in streams]
        assert [("busy" in f.header) for f in firsts if f is not None] == [False, True]
        state = await download_state(honest, serving.peer_id, KEY, allocate=ArrayBuffer)
        assert state.numel == 16 << 20 and sharing.served == 1
        assert donor.progress.states_served == 1  # what its next report says
        # the attacker's first stream sits unread: cut within the transfer's allowance
        await asyncio.sleep(state_sync.transfer_seconds(16 << 20) + 30)  # (virtual time)
        assert sharing.cut_slow == 1
        for transport in (attacker, honest, serving):
            await transport.close()

    run_virtual(main())


def test_at_most_two_sketches_at_once_however_they_end() -> None:
    """Each sketch exports the whole state: a donor answers two at a time. (The count was reset
    to zero when any sketch ended, so askers that came one by one ran any number at once.)"""
    class Gated(Donor):
        """Each export waits for its own gate: the sketches stay under way until let go."""

        def __init__(self) -> None:
            super().__init__()
            self.gates: list[asyncio.Event] = []

        async def export_state(self) -> DownloadedState:
            gate = asyncio.Event()
            self.gates.append(gate)
            await gate.wait()
            return await super().export_state()

    async def main() -> None:
        donor = Gated()
        handlers = HandlerTransport("donor")
        StateSharing(handlers, lambda key: donor)  # type: ignore[arg-type]
        sharing = handlers.handlers[state_sync.SKETCH_METHOD].__self__

        def ask(peer: str) -> asyncio.Future[Message]:
            header = {"key": KEY, "seed": 1, "count": 10, "epoch": donor.epoch,
                      "lineage": donor.lineage}
            return asyncio.ensure_future(handlers.handlers[state_sync.SKETCH_METHOD](
                RequestContext(peer), Message(header)))

        async def exports(n: int) -> None:
            for _ in range(1000):  # (virtual time: the asks reach their exports within a step)
                if len(donor.gates) >= n:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{len(donor.gates)} exports under way, not {n}")

        first, second = ask("peer-a"), ask("peer-b")
        await exports(2)
        donor.gates[0].set()
        assert "sketch" in (await first).header
        third = ask("peer-c")  # one under way: a second may start
        await exports(3)
        with pytest.raises(DonorBusy):  # two under way
            await ask("peer-d")
        for gate in donor.gates[1:]:
            gate.set()
        for answered in (second, third):
            assert "sketch" in (await answered).header
        assert (sharing.sketched, sharing.refused_sketches) == (3, 1)

    run_virtual(main())


def test_a_donor_that_served_two_lately_sends_a_receiver_with_other_donors_elsewhere() -> None:
    """A flash crowd: a donor that began RECENT_SERVES downloads in the last RECENT_SERVE_SECONDS
    sheds a receiver that says it has other donors to ask (busy, with when it takes one again),
    and serves one that has none, or that does not say (a peer of an earlier version); once the
    window has passed it serves a receiver with others again."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))  # (the donor's window is on the virtual clock)
        donor = Donor()
        network = SimNetwork()
        serving = SimTransport.start_on(network, network.add_host(), Identity.generate())
        sharing = StateSharing(serving, lambda key: donor)
        askers = [SimTransport.start_on(network, network.add_host(), Identity.generate())
                  for _ in range(6)]
        for asker in askers:
            asker.learn_addresses(serving.peer_id, serving.listen_addresses())
        began = loop.time()
        for asker in askers[:2]:  # one after the other: never two at once
            state = await download_state(asker, serving.peer_id, KEY, allocate=ArrayBuffer,
                                         others=5)
            assert state.numel == 1000
        with pytest.raises(DonorBusy, match="ask another donor") as shed:
            await download_state(askers[2], serving.peer_id, KEY, allocate=ArrayBuffer, others=5)
        assert shed.value.shed
        # (until the first of the two is RECENT_SERVE_SECONDS old)
        elapsed = loop.time() - began
        assert state_sync.RECENT_SERVE_SECONDS - elapsed <= shed.value.retry_after \
            <= state_sync.RECENT_SERVE_SECONDS
        assert sharing.shed == 1
        # no other donor to ask (or a receiver that does not say): served as before
        for asker in askers[3:5]:
            state = await download_state(asker, serving.peer_id, KEY, allocate=ArrayBuffer)
            assert state.numel == 1000
        assert sharing.served == 4 and sharing.shed == 1
        # the window passed since the last two began: a receiver with others is served again
        await asyncio.sleep(state_sync.RECENT_SERVE_SECONDS)
        state = await download_state(askers[5], serving.peer_id, KEY, allocate=ArrayBuffer,
                                     others=5)
        assert state.numel == 1000 and sharing.served == 5
        for transport in (*askers, serving):
            await transport.close()

    run_virtual(main())


@pytest.mark.parametrize("answer", [
    {"busy": "x", "retry_after": float("nan"), "shed": True},
    {"busy": "x", "retry_after": 1e308, "shed": True},
    {"busy": "x", "retry_after": -5, "shed": True},
    {"busy": "x", "retry_after": True, "shed": True},
    {"busy": "x" * 60_000, "retry_after": 3, "shed": "yes"},
])
def test_a_donors_busy_answer_is_bounded(answer: dict[str, Any]) -> None:
    """A donor's retry time is its own word: out of [0, RECENT_SERVE_SECONDS] (or not a number)
    it is BUSY_RETRY_SECONDS; "shed" counts only as the literal true, and only where we said we
    had others to ask; its reason is cut short in our error."""
    async def main() -> None:
        serving, asking = _answering(answer)
        for others in (0, 3):
            with pytest.raises(DonorBusy) as busy:
                await download_state(asking, serving.peer_id, KEY, allocate=ArrayBuffer,
                                     others=others)
            assert 0 <= busy.value.retry_after <= state_sync.RECENT_SERVE_SECONDS
            assert busy.value.shed == (others > 0 and answer["shed"] is True)
            assert len(str(busy.value)) < 400
        await asking.close()
        await serving.close()

    run_virtual(main())


def test_requests_that_end_early_do_not_make_a_donor_shed_others() -> None:
    """A stranger that asks twice, one after the other, and aborts at the header (a state too
    large for it) was served nothing: an honest receiver with other donors is served, not
    shed for 10 s (the donor counts downloads served in full, and those under way)."""
    async def main() -> None:
        timebase.use(SkewedClock(asyncio.get_running_loop()))
        donor = Donor(size=4 << 20)  # 16 MiB: more than the links hold once the receiver left
        network = SimNetwork()
        serving = SimTransport.start_on(network, network.add_host(), Identity.generate())
        sharing = StateSharing(serving, lambda key: donor)
        hostile, honest = (SimTransport.start_on(network, network.add_host(), Identity.generate())
                           for _ in range(2))
        for transport in (hostile, honest):
            transport.learn_addresses(serving.peer_id, serving.listen_addresses())
        for _ in range(2):
            with pytest.raises(StateSyncError, match="refused before allocating"):
                await download_state(hostile, serving.peer_id, KEY, allocate=ArrayBuffer,
                                     max_numel=1, others=3)
            await asyncio.sleep(5.0)  # (the donor's stream fails: that request is over)
        state = await download_state(honest, serving.peer_id, KEY, allocate=ArrayBuffer, others=3)
        assert state.numel == 4 << 20 and sharing.shed == 0 and sharing.served == 1
        for transport in (hostile, honest, serving):
            await transport.close()

    run_virtual(main())

