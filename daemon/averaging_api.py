"""Control-API methods for averaging: any local program can average a buffer with its peers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from dedloc.rpc import ErrorCode, rpc_method

from . import timebase
from .averaging.allreduce import AllReduceError
from .averaging.averager import NonFiniteVector, RoundOptions
from .averaging.errors import AveragingError
from .averaging.shm import SharedBufferError, attach

if TYPE_CHECKING:
    from .network import PeerNetwork

ERROR_MAP: dict[type[BaseException], ErrorCode] = {
    SharedBufferError: ErrorCode.BUFFER_ERROR,
    AllReduceError: ErrorCode.BUFFER_ERROR,
    NonFiniteVector: ErrorCode.BUFFER_ERROR,
    AveragingError: ErrorCode.AVERAGING_ERROR,
}


class AveragingApi:
    def __init__(self, network: PeerNetwork) -> None:
        self._network = network

    @rpc_method("averaging.average", errors=(ErrorCode.NOT_JOINED, ErrorCode.BUFFER_ERROR,
                                             ErrorCode.AVERAGING_ERROR))
    async def average(
        self,
        key: Annotated[str, "The round's key: every peer that averages under it joins one group "
                       "(use a fresh key per round, e.g. run/round-12)."],
        buffer: Annotated[str, "Name of a POSIX shared-memory object holding the vector; it is "
                          "replaced by the average in place."],
        length: Annotated[int, "Number of elements of the vector.", {"minimum": 1}],
        dtype: Annotated[Literal["float32"], "Element type."] = "float32",
        weight: Annotated[float, "This peer's weight (e.g. samples accumulated).", {"minimum": 0}] = 1.0,
        role: Annotated[Literal["trainer", "aux", "client"], "trainer: sends and reduces; aux: only "
                        "reduces (weight 0); client: only sends."] = "trainer",
        timeout: Annotated[float, "Seconds the whole round may take.", {"exclusiveMinimum": 0}] = 60.0,
        expected_peers: Annotated[int | None, "Stop gathering peers once this many (with us) are "
                                  "seen.", {"minimum": 1}] = None,
        compression: Annotated[Literal["none", "fp16", "uint8", "quantile8", "topk"], "Per-chunk wire "
                               "compression."] = "none",
        aggregation: Annotated[Literal["mean", "norm_clip"], "How the reducers combine the "
                               "contributions (every peer of the round must ask for the same): "
                               "mean (weighted) or norm_clip (each clipped to 4 times the median "
                               "norm of its chunk, then the weighted mean)."] = "mean",
        window: Annotated[float | None, "Seconds matchmaking gathers peers (default: "
                          "averaging.window).", {"exclusiveMinimum": 0}] = None,
    ) -> Annotated[dict[str, Any], "The round: group_id, group_size, members, shares, seconds, "
                   "bytes_sent, bytes_received, failed_parts (element ranges left at the local "
                   "value), senders_excluded (peer: why), senders_rejected (peer: offence, for "
                   "contributions this peer's reducer rejected)."]:
        """Average a shared-memory vector with the peers averaging under the same key."""
        averager = self._network.require_averager()
        options = RoundOptions(key=key, weight=weight, role=role, deadline=timebase.now() + timeout,
                               compression=compression, aggregation=aggregation,
                               expected=expected_peers, window=window)
        with attach(buffer, length, dtype) as vector:
            return (await averager.average(vector, options)).to_json()

    @rpc_method("averaging.status", errors=(ErrorCode.NOT_JOINED,))
    async def status(self) -> Annotated[dict[str, Any], "rounds (the last ones, newest last), "
                                        "counters (offences, bans, refused_banned, ...), bans "
                                        "(active: peer_id, until, reason; offenders), "
                                        "avoided_leaders (peers this daemon's matchmaking ranks "
                                        "last for a while: rounds they led failed it twice in a "
                                        "row; counted in `leaders_avoided`), screening (the "
                                        "rules in force), bandwidth (measured bytes per "
                                        "second)."]:
        """The last averaging rounds: group size, shares, bytes, seconds, failures; the peers
        banned for bad contributions; and bandwidth."""
        return self._network.require_averager().status()
