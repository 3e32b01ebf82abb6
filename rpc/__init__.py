"""JSON-RPC 2.0 over unix sockets: the one protocol of dedloc's control API and worker protocol.

A control API may also listen on a loopback TCP port, for clients that authenticate with a token.

This layer imports nothing else of dedloc's.
"""

from .access import (
    TOKEN_FILE_NAME,
    TOKEN_METHOD,
    AccessError,
    LocalUsers,
    PeerCredentials,
    load_or_create_token,
    loopback_address,
    read_token,
)
from .client import JsonRpcClient
from .errors import (
    ERROR_DESCRIPTIONS,
    ErrorCode,
    InvalidParams,
    RpcCallError,
    RpcConnectionError,
    RpcError,
    RpcProtocolError,
    RpcTimeoutError,
)
from .registry import MethodRegistry, error_response, rpc_method
from .schema import ParamSpec, Signature, schema_of
from .server import JsonRpcServer, SocketInUseError

__all__ = [
    "ERROR_DESCRIPTIONS",
    "TOKEN_FILE_NAME",
    "TOKEN_METHOD",
    "AccessError",
    "ErrorCode",
    "InvalidParams",
    "JsonRpcClient",
    "JsonRpcServer",
    "LocalUsers",
    "MethodRegistry",
    "ParamSpec",
    "PeerCredentials",
    "RpcCallError",
    "RpcConnectionError",
    "RpcError",
    "RpcProtocolError",
    "RpcTimeoutError",
    "Signature",
    "SocketInUseError",
    "error_response",
    "load_or_create_token",
    "loopback_address",
    "read_token",
    "rpc_method",
    "schema_of",
]
