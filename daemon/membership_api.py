"""Control-API methods of closed runs' owners: issue, revoke and list membership tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from dedloc.rpc import ErrorCode, InvalidParams, rpc_method

from .collab.errors import MembershipError
from .collab.settings import RUN_NAME
from .dht.records import is_peer_id

if TYPE_CHECKING:
    from .collab.runs import RunRegistry

ERROR_MAP: dict[type[BaseException], ErrorCode] = {MembershipError: ErrorCode.MEMBERSHIP_ERROR}

RunName = Annotated[str, "The closed run's name (this daemon owns the runs it creates with "
                    "closed=true)."]


class MembershipApi:
    def __init__(self, runs: RunRegistry) -> None:
        self._runs = runs

    @rpc_method("token.issue", errors=(ErrorCode.MEMBERSHIP_ERROR, ErrorCode.RUN_NOT_ACTIVE))
    async def issue(
        self,
        name: RunName,
        peer: Annotated[str, "The peer id of the volunteer's daemon (`dedloc info` shows it)."],
        role: Annotated[Literal["trainer", "aux"], "What the token admits: a trainer (which may "
                        "also join as aux) or an aux peer only."] = "trainer",
        days: Annotated[float, "Days until the token expires.", {"exclusiveMinimum": 0,
                                                                   "maximum": 3650}] = 30.0,
    ) -> dict[str, Any]:
        """Sign a token that lets one peer take part in a closed run this daemon owns.

        The answer's `token` is what the volunteer passes to `run.start` (`dedloc join --token`).
        It names the peer and carries the run's key (which the run's DHT records are encrypted
        with) sealed to that peer, so it is useless to anyone else; it is recorded for
        `token.list`.
        """
        if not is_peer_id(peer):
            raise InvalidParams("peer", f"{peer!r:.80} is not a peer id (the volunteer's `dedloc "
                                        "info` shows it)")
        if not RUN_NAME.match(name):
            raise InvalidParams("name", "1-64 letters, digits, '_', '.' or '-', starting with a "
                                        "letter or digit")
        return self._runs.token_issue(name, peer, role, days)

    @rpc_method("token.revoke", errors=(ErrorCode.MEMBERSHIP_ERROR, ErrorCode.RUN_NOT_ACTIVE))
    async def revoke(
        self,
        name: RunName,
        serial: Annotated[str | None, "The serial of one token (token.list shows them)."] = None,
        peer: Annotated[str | None, "A peer id: every token of that peer, now and later."] = None,
    ) -> dict[str, Any]:
        """Revoke a token (or every token of a peer) and publish the run's revocation list.

        Members fetch the list every 30 s and refuse the revoked peer from then on; `published`
        says whether the DHT took the new list and re-keying records (if not, they are tried
        again after 5 s, backing off to 5 min). The revocation draws a new `generation` of the
        run's key, sealed to each remaining member; `rekeyed` is false (with `rekey_error`, what
        to do) when the members were too many to re-key: the revoked peer then still reads what
        they write. Records written before stay readable to it.
        """
        return await self._runs.token_revoke(name, serial, peer)

    @rpc_method("token.list", errors=(ErrorCode.RUN_NOT_ACTIVE,))
    async def listing(self, name: RunName) -> dict[str, Any]:
        """The tokens this daemon issued for a closed run, with their state (revoked, expired)."""
        return self._runs.token_list(name)
