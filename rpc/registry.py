"""A registry of JSON-RPC methods: validation, dispatch (jsonrpcserver) and the OpenRPC document.

Methods are plain async functions (or bound methods) with type hints. `@rpc_method("node.info")`
marks them; `MethodRegistry.register_object` collects the marked methods of an object. The
registry wraps each method so that parameters are checked against the schema derived from its
hints before it runs, errors map to stable codes, and unexpected exceptions become an internal
error that is logged, never a crash.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from jsonrpcserver import Error, Success
from jsonrpcserver.async_main import dispatch_to_serializable

from .errors import ERROR_DESCRIPTIONS, ErrorCode, RpcCallError
from .schema import Signature

log = structlog.get_logger(__name__)

Handler = Callable[..., Awaitable[Any]]
_MARK = "__dedloc_rpc_method__"


def rpc_method(name: str, *, errors: tuple[ErrorCode, ...] = ()) -> Callable[[Handler], Handler]:
    """Mark an async method as the JSON-RPC method `name`; `errors` lists the codes it may answer."""

    def mark(func: Handler) -> Handler:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(f"{func.__qualname__}: JSON-RPC methods must be async")
        setattr(func, _MARK, (name, errors))
        return func

    return mark


@dataclass(frozen=True)
class RegisteredMethod:
    name: str
    handler: Handler
    signature: Signature
    summary: str
    description: str
    errors: tuple[ErrorCode, ...]

    def to_openrpc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "summary": self.summary,
            "paramStructure": "either",
            "params": [p.to_openrpc() for p in self.signature.params],
            "result": {"name": "result", "schema": self.signature.result},
        }
        if self.description:
            doc["description"] = self.description
        codes = (ErrorCode.INVALID_PARAMS, *self.errors)
        doc["errors"] = [{"$ref": f"#/components/errors/{ErrorCode(c).name}"} for c in codes]
        return doc


class MethodRegistry:
    """The methods one JSON-RPC server answers, and the counters of what it answered."""

    def __init__(self, title: str, version: str, description: str = "",
                 error_map: dict[type[BaseException], ErrorCode] | None = None,
                 max_batch: int = 1000) -> None:
        self.title = title
        self.max_batch = max_batch
        self.version = version
        self.description = description
        self._methods: dict[str, RegisteredMethod] = {}
        self._callables: dict[str, Callable[..., Awaitable[Any]]] = {}
        self._error_map = dict(error_map or {})
        self.counters: Counter[str] = Counter()
        self.register("rpc.discover", self._discover)

    def register(self, name: str, handler: Handler, errors: tuple[ErrorCode, ...] = ()) -> None:
        if name in self._methods:
            raise ValueError(f"JSON-RPC method {name!r} registered twice")
        doc = inspect.getdoc(handler) or ""
        # The summary is the first paragraph (a first sentence may wrap), on one line.
        first, _, description = doc.partition("\n\n")
        summary = " ".join(first.split())
        if not summary:
            raise TypeError(f"{name}: a JSON-RPC method needs a docstring (it is its documentation)")
        method = RegisteredMethod(
            name, handler, Signature.of(handler), summary.strip(), description.strip(), errors
        )
        self._methods[name] = method
        self._callables[name] = self._wrap(method)

    def register_object(self, obj: object) -> None:
        """Register every method of `obj` marked with `@rpc_method`."""
        for attr in dir(type(obj)):
            func = getattr(type(obj), attr, None)
            mark = getattr(func, _MARK, None)
            if mark is not None:
                name, errors = mark
                self.register(name, getattr(obj, attr), errors)

    @property
    def names(self) -> list[str]:
        return sorted(self._methods)

    async def _discover(self) -> dict[str, Any]:
        """The OpenRPC document of this server: every method, its parameters, result and errors."""
        return self.openrpc()

    def openrpc(self) -> dict[str, Any]:
        return {
            "openrpc": "1.3.2",
            "info": {"title": self.title, "version": self.version, "description": self.description},
            "methods": [self._methods[n].to_openrpc() for n in self.names],
            "components": {
                "errors": {
                    code.name: {"code": int(code), "message": ERROR_DESCRIPTIONS[code]}
                    for code in ErrorCode
                }
            },
        }

    def _wrap(self, method: RegisteredMethod) -> Callable[..., Awaitable[Any]]:
        async def call(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = method.signature.bind(list(args), kwargs)
                return Success(await method.handler(**bound))
            except RpcCallError as exc:
                return Error(int(exc.code), exc.message, exc.data)
            except Exception as exc:
                code = self._code_for(exc)
                if code is None:
                    log.exception("rpc_method_failed", method=method.name)
                    return Error(int(ErrorCode.INTERNAL_ERROR), "Internal error",
                                 f"{type(exc).__name__}: {exc}")
                return Error(int(code), str(exc), getattr(exc, "data", None))

        return call

    def _code_for(self, exc: BaseException) -> ErrorCode | None:
        for cls in type(exc).__mro__:
            if cls in self._error_map:
                return self._error_map[cls]
        return None

    async def dispatch(self, request: bytes) -> bytes | None:
        """Answer one JSON-RPC message (a request, a notification or a batch); None: no answer."""
        try:
            parsed = orjson.loads(request)
        except orjson.JSONDecodeError as exc:
            self.counters["error.parse"] += 1
            return error_response(ErrorCode.PARSE_ERROR, "Parse error", str(exc))
        if not isinstance(parsed, list):
            answer = await self._dispatch_one(parsed)
        elif not parsed:
            self.counters["error.invalid_request"] += 1
            return error_response(ErrorCode.INVALID_REQUEST, "Invalid request", "empty batch")
        elif len(parsed) > self.max_batch:  # each element costs a task and an answer: bound them
            self.counters["error.batch_too_large"] += 1
            return error_response(ErrorCode.INVALID_REQUEST, "Invalid request",
                                  f"batch of {len(parsed)} requests is over the limit of {self.max_batch}")
        else:
            # Each element on its own, so one bad element does not spoil the others' answers.
            answers = await asyncio.gather(*(self._dispatch_one(item) if not isinstance(item, list)
                                             else self._nested_batch() for item in parsed))
            answer = [a for a in answers if a is not None] or None
        if answer is None:
            return None
        if isinstance(answer, list):
            return b"[" + b",".join(self._encode(a) for a in answer) + b"]"
        return self._encode(answer)

    def _encode(self, answer: Any) -> bytes:
        """One answer as JSON; a result orjson cannot encode (e.g. a DHT value a peer nested 300
        deep) becomes an internal error for that request alone, not a broken connection."""
        try:
            return orjson.dumps(answer)
        except TypeError as exc:
            self.counters["error.unencodable_result"] += 1
            log.error("rpc_result_unencodable", error=str(exc))
            request_id = answer.get("id") if isinstance(answer, dict) else None
            return orjson.dumps({"jsonrpc": "2.0", "id": request_id, "error": {
                "code": int(ErrorCode.INTERNAL_ERROR), "message": "Internal error",
                "data": f"the result cannot be encoded as JSON: {exc}"}})

    async def _nested_batch(self) -> Any:
        """A batch inside a batch is not a request (jsonrpcserver would run it as a batch)."""
        self.counters["requests"] += 1
        self.counters["error.invalid_request"] += 1
        return orjson.loads(error_response(ErrorCode.INVALID_REQUEST, "Invalid request",
                                           "a batch may not contain a batch"))

    async def _dispatch_one(self, request: Any) -> Any:
        answer = await dispatch_to_serializable(request, self._callables, deserializer=_identity)
        self._count(request, answer)
        return answer

    def _count(self, request: Any, answer: Any) -> None:
        self.counters["requests"] += 1
        error = answer.get("error") if isinstance(answer, dict) else None
        if error:
            try:
                name = ErrorCode(error["code"]).name.lower()
            except ValueError:
                name = str(error["code"])
            self.counters[f"error.{name}"] += 1


def _identity(request: Any) -> Any:
    return request


def error_response(code: ErrorCode, message: str, data: Any = None) -> bytes:
    """A JSON-RPC error answer with a null id (for requests that could not be read)."""
    error: dict[str, Any] = {"code": int(code), "message": message}
    if data is not None:
        error["data"] = data
    return orjson.dumps({"jsonrpc": "2.0", "error": error, "id": None})
