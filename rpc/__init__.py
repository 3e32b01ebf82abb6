"""JSON-RPC 2.0 over unix sockets: the one protocol of dedloc's control API and worker protocol.

This layer imports nothing else of dedloc's.
"""

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
    "ErrorCode",
    "InvalidParams",
    "JsonRpcClient",
    "JsonRpcServer",
    "MethodRegistry",
    "ParamSpec",
    "RpcCallError",
    "RpcConnectionError",
    "RpcError",
    "RpcProtocolError",
    "RpcTimeoutError",
    "Signature",
    "SocketInUseError",
    "error_response",
    "rpc_method",
    "schema_of",
]
