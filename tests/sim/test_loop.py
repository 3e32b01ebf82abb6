"""The simulator's event loop: virtual time jumps over idle waits, stalls are named."""

from __future__ import annotations

import asyncio

import pytest

from dedloc.sim.loop import START, SimulationStalled, VirtualClockLoop, run_virtual


def test_an_hour_of_sleeping_takes_no_wall_time() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        begin = loop.time()
        await asyncio.gather(asyncio.sleep(3600), asyncio.sleep(1800))
        return begin, loop.time()

    begin, end = run_virtual(main())  # on virtual time: no wall-clock wait, whatever the load
    assert begin == START
    assert end - begin == pytest.approx(3600)


def test_timers_fire_in_order_of_virtual_time() -> None:
    async def main() -> list[str]:
        order: list[str] = []

        async def after(seconds: float, name: str) -> None:
            await asyncio.sleep(seconds)
            order.append(name)

        await asyncio.gather(after(3, "c"), after(1, "a"), after(2, "b"))
        return order

    assert run_virtual(main()) == ["a", "b", "c"]


def test_a_timeout_expires_on_virtual_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        begin = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.Event().wait()
        return loop.time() - begin

    assert run_virtual(main()) == pytest.approx(5)


def test_waiting_for_what_nothing_will_bring_is_a_stall() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(SimulationStalled):
        run_virtual(main())


def test_threads_run_inline_in_no_virtual_time() -> None:
    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualClockLoop)
        begin = loop.time()
        value = await asyncio.to_thread(sum, range(10))
        return value, loop.time() - begin

    assert run_virtual(main()) == (45, 0.0)
