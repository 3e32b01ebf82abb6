"""The method registry: parameter validation, error codes, batches and the OpenRPC document."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict

import orjson
import pytest

from dedloc.rpc import ErrorCode, MethodRegistry, RpcCallError, rpc_method


class Sum(TypedDict):
    total: int


class Broken(Exception):
    pass


class Api:
    @rpc_method("math.add")
    async def add(self, a: Annotated[int, "first term"], b: int = 1,
                  mode: Literal["plain", "double"] = "plain") -> Sum:
        """Add two integers.

        Longer text that ends up in the description.
        """
        total = a + b
        return {"total": total * 2 if mode == "double" else total}

    @rpc_method("math.fail", errors=(ErrorCode.RUN_EXISTS,))
    async def fail(self, how: str) -> None:
        """Fail on purpose."""
        if how == "known":
            raise RpcCallError(ErrorCode.RUN_EXISTS, "it exists", {"name": "x"})
        if how == "mapped":
            raise Broken("mapped failure")
        raise RuntimeError("a bug")

    @rpc_method("echo")
    async def echo(self, value: Any = None, items: list[int] | None = None) -> dict[str, Any]:
        """Return what was given."""
        return {"value": value, "items": items}


@pytest.fixture
def registry() -> MethodRegistry:
    registry = MethodRegistry("test", "1.0", error_map={Broken: ErrorCode.WORKER_FAILED})
    registry.register_object(Api())
    return registry


async def ask(registry: MethodRegistry, request: Any) -> Any:
    raw = request if isinstance(request, bytes) else orjson.dumps(request)
    answer = await registry.dispatch(raw)
    return None if answer is None else orjson.loads(answer)


def req(method: str, params: Any = None, id: int | None = 1) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    if id is not None:
        message["id"] = id
    return message


async def test_named_and_positional_params(registry: MethodRegistry) -> None:
    assert (await ask(registry, req("math.add", {"a": 2, "b": 3})))["result"] == {"total": 5}
    assert (await ask(registry, req("math.add", [2, 3, "double"])))["result"] == {"total": 10}
    assert (await ask(registry, req("math.add", {"a": 2})))["result"] == {"total": 3}


@pytest.mark.parametrize(("params", "param", "reason"), [
    ({"a": "2"}, "a", "is not of type 'integer'"),
    ({}, "a", "missing required parameter"),
    ({"a": 1, "c": 2}, "c", "unknown parameter"),
    ({"a": 1, "mode": "triple"}, "mode", "is not one of"),
    ({"a": True}, "a", "is not of type 'integer'"),
    ([1, 2, "plain", 4], None, "at most 3 positional"),
])
async def test_invalid_params_name_the_parameter(registry: MethodRegistry, params: Any,
                                                 param: str | None, reason: str) -> None:
    error = (await ask(registry, req("math.add", params)))["error"]
    assert error["code"] == ErrorCode.INVALID_PARAMS
    assert error["data"]["param"] == param
    assert reason in error["data"]["reason"]


async def test_nested_type_errors_say_where(registry: MethodRegistry) -> None:
    error = (await ask(registry, req("echo", {"items": [1, "x"]})))["error"]
    assert error["data"]["param"] == "items"


async def test_standard_errors(registry: MethodRegistry) -> None:
    assert (await ask(registry, b"{not json"))["error"]["code"] == ErrorCode.PARSE_ERROR
    assert (await ask(registry, b"42"))["error"]["code"] == ErrorCode.INVALID_REQUEST
    assert (await ask(registry, b"[]"))["error"]["code"] == ErrorCode.INVALID_REQUEST
    assert (await ask(registry, {"method": "echo", "id": 1}))["error"]["code"] == ErrorCode.INVALID_REQUEST
    assert (await ask(registry, req("nope")))["error"]["code"] == ErrorCode.METHOD_NOT_FOUND


async def test_application_and_internal_errors(registry: MethodRegistry) -> None:
    known = (await ask(registry, req("math.fail", {"how": "known"})))["error"]
    assert known == {"code": ErrorCode.RUN_EXISTS, "message": "it exists", "data": {"name": "x"}}
    mapped = (await ask(registry, req("math.fail", {"how": "mapped"})))["error"]
    assert mapped["code"] == ErrorCode.WORKER_FAILED and mapped["message"] == "mapped failure"
    internal = (await ask(registry, req("math.fail", {"how": "bug"})))["error"]
    assert internal["code"] == ErrorCode.INTERNAL_ERROR
    assert "RuntimeError: a bug" in internal["data"]
    # and it still answers
    assert (await ask(registry, req("math.add", {"a": 1})))["result"] == {"total": 2}


async def test_batches_and_notifications(registry: MethodRegistry) -> None:
    answer = await ask(registry, [req("math.add", {"a": 1}, id=1), req("math.add", {"a": 1}, id=None),
                                  req("nope", id=3), 7])
    by_id = {item["id"]: item for item in answer}
    assert by_id[1]["result"] == {"total": 2}
    assert by_id[3]["error"]["code"] == ErrorCode.METHOD_NOT_FOUND
    assert by_id[None]["error"]["code"] == ErrorCode.INVALID_REQUEST
    assert len(answer) == 3
    assert await ask(registry, req("math.add", {"a": 1}, id=None)) is None


async def test_counters(registry: MethodRegistry) -> None:
    await ask(registry, b"{")
    await ask(registry, req("math.add", {"a": "x"}))
    await ask(registry, req("math.add", {"a": 1}))
    assert registry.counters["error.parse"] == 1
    assert registry.counters["error.invalid_params"] == 1
    assert registry.counters["requests"] == 2


async def test_openrpc_document_comes_from_the_code(registry: MethodRegistry) -> None:
    doc = (await ask(registry, req("rpc.discover")))["result"]
    methods = {m["name"]: m for m in doc["methods"]}
    assert set(methods) == {"rpc.discover", "math.add", "math.fail", "echo"}
    add = methods["math.add"]
    assert add["summary"] == "Add two integers."
    assert "Longer text" in add["description"]
    params = {p["name"]: p for p in add["params"]}
    assert params["a"] == {"name": "a", "required": True, "description": "first term",
                           "schema": {"type": "integer", "description": "first term"}}
    assert params["mode"]["schema"] == {"enum": ["plain", "double"], "default": "plain"}
    assert add["result"]["schema"]["properties"] == {"total": {"type": "integer"}}
    refs = [e["$ref"] for e in methods["math.fail"]["errors"]]
    assert "#/components/errors/RUN_EXISTS" in refs
    assert doc["components"]["errors"]["RUN_EXISTS"]["code"] == ErrorCode.RUN_EXISTS


def test_registration_is_checked() -> None:
    registry = MethodRegistry("t", "1")

    async def undocumented(x: int) -> int:
        return x

    async def unhinted(x):  # type: ignore[no-untyped-def]
        """Has no hints."""
        return x

    with pytest.raises(TypeError, match="docstring"):
        registry.register("a", undocumented)
    with pytest.raises(TypeError, match="no type hint"):
        registry.register("b", unhinted)
    with pytest.raises(ValueError, match="twice"):
        registry.register("rpc.discover", registry._discover)


async def test_a_summary_that_wraps_is_its_whole_first_paragraph() -> None:
    async def pause() -> int:
        """Pause training on this node until node.resume: every run leaves
        its rounds.

        More text here."""
        return 1

    registry = MethodRegistry("t", "1")
    registry.register("node.pause", pause)
    doc = (await ask(registry, req("rpc.discover")))["result"]
    (described,) = [m for m in doc["methods"] if m["name"] == "node.pause"]
    assert described["summary"] == ("Pause training on this node until node.resume: every run "
                                    "leaves its rounds.")
    assert described["description"] == "More text here."
