"""Errors of the JSON-RPC layer and the stable error codes of every dedloc JSON-RPC API.

The codes are part of the public API: programs in other languages switch on them, so a code is
never reused for another meaning. Standard JSON-RPC 2.0 codes are negative; application codes are
in the 1000-1999 range and documented in the OpenRPC document (`rpc.discover`).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ErrorCode(IntEnum):
    """Every error code a dedloc JSON-RPC server may answer with."""

    PARSE_ERROR = -32700
    INVALID_REQUEST = -32600
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603

    SHUTTING_DOWN = 1000
    UNKNOWN_WORKLOAD = 1001
    INVALID_WORKLOAD_CONFIG = 1002
    RUN_EXISTS = 1003
    UNKNOWN_RUN = 1004
    WORKER_FAILED = 1005
    RUN_NOT_ACTIVE = 1006
    PLUGIN_ERROR = 1007
    BUFFER_ERROR = 1008
    WORKLOAD_ERROR = 1009
    CHECKPOINT_ERROR = 1010
    NOT_JOINED = 1011
    PEER_UNREACHABLE = 1012
    PEER_ID_MISMATCH = 1013
    DHT_REFUSED = 1014
    AVERAGING_ERROR = 1015
    MANIFEST_ERROR = 1016
    ACCESS_DENIED = 1017
    MEMBERSHIP_ERROR = 1018


ERROR_DESCRIPTIONS: dict[ErrorCode, str] = {
    ErrorCode.PARSE_ERROR: "The request is not valid JSON.",
    ErrorCode.INVALID_REQUEST: "The JSON is not a JSON-RPC 2.0 request object, or it is too large.",
    ErrorCode.METHOD_NOT_FOUND: "No method of that name; `rpc.discover` lists them all.",
    ErrorCode.INVALID_PARAMS: "A parameter is missing, unknown or of the wrong type; "
    "`data.param` names it and `data.reason` says what is wrong.",
    ErrorCode.INTERNAL_ERROR: "A bug on the server side; the server logged it and keeps serving.",
    ErrorCode.SHUTTING_DOWN: "The server is shutting down and takes no new work.",
    ErrorCode.UNKNOWN_WORKLOAD: "No installed workload has that name; `workloads.list` lists them.",
    ErrorCode.INVALID_WORKLOAD_CONFIG: "The workload config has an unknown key or a wrong value; "
    "`data.key` names it.",
    ErrorCode.RUN_EXISTS: "A run of that name is already active; stop it first or pick another name.",
    ErrorCode.UNKNOWN_RUN: "No run of that name; `run.status` lists the runs.",
    ErrorCode.WORKER_FAILED: "The worker process failed to start or died; `data` holds its exit "
    "code and last log lines.",
    ErrorCode.RUN_NOT_ACTIVE: "The run is not in a state that allows this call.",
    ErrorCode.PLUGIN_ERROR: "A workload plugin failed to load; `data.plugin` names it.",
    ErrorCode.BUFFER_ERROR: "A shared-memory buffer is missing or has the wrong size or dtype.",
    ErrorCode.WORKLOAD_ERROR: "The workload's own code raised an error; `data` holds its message.",
    ErrorCode.CHECKPOINT_ERROR: "A checkpoint could not be written or read.",
    ErrorCode.NOT_JOINED: "The node has not joined the network yet; try again shortly.",
    ErrorCode.PEER_UNREACHABLE: "No address of the peer answered.",
    ErrorCode.PEER_ID_MISMATCH: "The peer at that address is not the peer the address names.",
    ErrorCode.AVERAGING_ERROR: "An averaging round could not be run as asked (the message says why).",
    ErrorCode.MANIFEST_ERROR: "A collaborative run's manifest is invalid, or the run to join was not "
                              "found or is ambiguous (the message says which and what to give).",
    ErrorCode.ACCESS_DENIED: "The connection may not use this server: a unix client whose user is "
    "neither root, the daemon's user nor in its group, or a TCP client that did not authenticate "
    "with the right token first (`data` says which and what to do). The server closes the "
    "connection, except after a wrong token while the connection has attempts left.",
    ErrorCode.MEMBERSHIP_ERROR: "A closed run's token is malformed, forged, expired, revoked or for "
    "another peer or run, or only the run's owner may do this (the message says which).",
    ErrorCode.DHT_REFUSED: "The DHT refused the record (too large, expired, or a sub-key owned by "
    "another peer); the message says which.",
}


class RpcError(Exception):
    """Root of the errors of the `rpc` layer."""


class RpcCallError(RpcError):
    """An error answer: raised by a method to answer the caller, received by a client.

    `code` is an `ErrorCode` (or any int from a foreign server), `data` any JSON value.
    """

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def __str__(self) -> str:
        text = f"{self.message} (code {self.code})"
        if self.data is not None:
            text += f": {self.data}"
        return text

    def to_json(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": int(self.code), "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


class InvalidParams(RpcCallError):
    """A parameter was wrong; the caller's fault."""

    def __init__(self, param: str | None, reason: str) -> None:
        super().__init__(ErrorCode.INVALID_PARAMS, "Invalid params", {"param": param, "reason": reason})
        self.param = param
        self.reason = reason


class RpcConnectionError(RpcError):
    """The server could not be reached, or the connection broke."""


class RpcTimeoutError(RpcError):
    """The server did not answer before the deadline."""


class RpcProtocolError(RpcError):
    """The peer sent something that is not JSON-RPC 2.0."""
