"""Control-API methods of the volunteer's limits: pause and resume training, and why it waits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, TypedDict

from dedloc.rpc import rpc_method

if TYPE_CHECKING:
    from .collab.runs import RunRegistry


class AvailabilityStatus(TypedDict):
    paused: Annotated[bool, "Paused by node.pause (it stays paused across restarts)."]
    blocked: Annotated[str | None, "Why the runs do not train now (paused, outside the training "
                       "hours, the machine busy), or null."]
    hours: Annotated[str, "The training hours (limits.hours), or always."]
    idle_only: Annotated[bool, "Training waits for the machine to be idle (limits.idle_only)."]
    others_cpu_share: Annotated[float | None, "Share of the CPU used by other programs at the "
                                "last sample (idle_only), or null."]


class LimitsApi:
    def __init__(self, runs: RunRegistry) -> None:
        self._runs = runs

    @rpc_method("node.pause")
    async def pause(self) -> AvailabilityStatus:
        """Stop training in every run until node.resume: each run finishes its current chunk,
        leaves its rounds (its peers stop waiting for it) and waits. Survives restarts."""
        return self._status(self._runs.pause())

    @rpc_method("node.resume")
    async def resume(self) -> AvailabilityStatus:
        """Undo node.pause; collaborative runs drop their stale gradients and catch up."""
        return self._status(self._runs.resume())

    @rpc_method("node.availability")
    async def availability(self) -> AvailabilityStatus:
        """Whether the runs may train now, and if not, why."""
        return self._status(self._runs.availability_status())

    @staticmethod
    def _status(status: dict[str, Any]) -> AvailabilityStatus:
        return status  # type: ignore[return-value]
