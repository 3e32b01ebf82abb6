"""Fuzzing the JSON-RPC layer: request parsing, dispatch, parameter validation, the socket server.

Properties: whatever a client sends, the registry answers with JSON-RPC 2.0 (one answer per
request that has an id, an error with a standard code for anything malformed, never an internal
error from our own code) and counts it; parameters bind to exactly what the schema allows or are
refused naming the culprit; the server answers every line and keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal, NotRequired, TypedDict

import jsonschema
import orjson
import pytest
from fuzz import rpcwire
from fuzz.fuzzutil import (
    Deep,
    daemon_recursion_limit,
    fuzz_settings,
    texts,
    to_json,
    wire_json,
    wire_values,
)
from hypothesis import example, given
from hypothesis import strategies as st

from dedloc.rpc import ErrorCode, InvalidParams, JsonRpcServer, MethodRegistry, rpc_method


class Options(TypedDict):
    """Options of a call."""

    name: str
    size: NotRequired[int]
    tags: NotRequired[list[str]]


class Api:
    @rpc_method("t.add")
    async def add(self, a: Annotated[int, "first"], b: int = 1) -> int:
        """Add."""
        return a + b

    @rpc_method("t.mixed")
    async def mixed(self, mode: Literal["x", "y"], ratio: float | None = None,
                    opts: Options | None = None, extra: dict[str, Any] | None = None,
                    pair: tuple[int, str] | None = None) -> dict[str, Any]:
        """Everything the schema supports."""
        return {"mode": mode, "ratio": ratio, "opts": opts, "extra": extra, "pair": pair}

    @rpc_method("t.any")
    async def any(self, value: Any = None) -> Any:
        """Echo anything."""
        return value

    @rpc_method("t.none")
    async def none(self) -> None:
        """No parameters."""

    @rpc_method("t.deep")
    async def deep(self, depth: int) -> Any:
        """A result nested `depth` deep (as a DHT value stored by a hostile peer may be)."""
        return wire_json(Deep(depth))


METHODS = ["t.add", "t.mixed", "t.any", "t.none", "rpc.discover", "no.such", ""]
PARAM_NAMES = ["a", "b", "mode", "ratio", "opts", "extra", "pair", "value", "name", "size"]
STANDARD_ERRORS = {ErrorCode.PARSE_ERROR, ErrorCode.INVALID_REQUEST, ErrorCode.METHOD_NOT_FOUND,
                   ErrorCode.INVALID_PARAMS}


def registry() -> MethodRegistry:
    made = MethodRegistry("fuzz", "1")
    made.register_object(Api())
    return made


REGISTRY = registry()

params = rpcwire.params(PARAM_NAMES, st.fixed_dictionaries(
    {"mode": st.sampled_from(["x", "y", "z"])},
    optional={"opts": st.fixed_dictionaries({"name": texts}, optional={
        "size": wire_values, "tags": st.lists(wire_values, max_size=3)}),
              "pair": st.lists(wire_values, max_size=3), "ratio": wire_values}))
lines = rpcwire.lines(st.one_of(st.sampled_from(METHODS), wire_values), params)


def check_answer(answer: Any) -> None:
    assert isinstance(answer, dict), answer
    assert answer.get("jsonrpc") == "2.0" and "id" in answer
    assert ("result" in answer) != ("error" in answer), answer
    if "error" in answer:
        error = answer["error"]
        assert isinstance(error["code"], int) and isinstance(error["message"], str)
        assert error["code"] in STANDARD_ERRORS, error  # none of these methods fails by itself


def expected_answers(parsed: Any) -> int | None:
    """How many answers a request (or batch) must get; None when unknown (a notification may or
    may not be one, depending on whether the rest of it is valid)."""
    if isinstance(parsed, list):
        return 1 if not parsed else None
    if isinstance(parsed, dict) and "id" in parsed:
        return 1
    return None if isinstance(parsed, dict) else 1


@given(lines)
@fuzz_settings()
@example(b"[" + b",".join([b"{}"] * 5000) + b"]")  # a batch bigger than the limit
@example(to_json([[{"jsonrpc": "2.0", "method": "t.add", "params": {"a": 1}, "id": 1}]]))  # nested
@example(to_json({"jsonrpc": "2.0", "method": "t.any", "params": {"value": Deep(1000)}, "id": 1}))
@example(to_json({"jsonrpc": "2.0", "method": "t.add", "params": {"a": Deep(1000)}, "id": 1}))
@example(to_json({"jsonrpc": "2.0", "method": "t.add", "params": [Deep(1000)], "id": 1}))
@example(to_json({"jsonrpc": "2.0", "method": "t.add", "params": {"a": 1}, "id": Deep(1000)}))
async def test_registry_answers_every_request(line: bytes) -> None:
    before = sum(REGISTRY.counters.values())
    with daemon_recursion_limit():
        raw = await REGISTRY.dispatch(line)
    try:
        parsed = orjson.loads(line)
    except orjson.JSONDecodeError:
        parsed = None
        assert raw is not None
    expected = expected_answers(parsed)
    if raw is None:
        assert expected is None
        return
    answer = orjson.loads(raw)
    answers = answer if isinstance(answer, list) else [answer]
    assert answers
    for one in answers:
        check_answer(one)
    if isinstance(parsed, list) and parsed and isinstance(answer, list):
        assert len(answers) <= len(parsed)
    assert sum(REGISTRY.counters.values()) > before


@given(st.sampled_from(["t.add", "t.mixed", "t.any", "t.none"]),
       st.one_of(st.lists(wire_values, max_size=6), st.none()),
       st.one_of(params.filter(lambda p: isinstance(p, dict)), st.none()))
@fuzz_settings(scale=0.5)
@example("t.mixed", None, {"mode": "x", "opts": {"name": "n", "size": True}})
@example("t.mixed", None, {"mode": "x", "pair": [1, Deep(1000)]})
def test_parameters_bind_or_name_the_culprit(method: str, args: list[Any] | None,
                                             kwargs: dict[str, Any] | None) -> None:
    signature = REGISTRY._methods[method].signature
    args, kwargs = wire_json(args), wire_json(kwargs)
    with daemon_recursion_limit():
        try:
            bound = signature.bind(args, kwargs)
        except InvalidParams as exc:
            assert exc.code == ErrorCode.INVALID_PARAMS and isinstance(exc.reason, str)
            assert exc.param is None or isinstance(exc.param, str)
            return
    assert set(bound) == {p.name for p in signature.params}
    for spec in signature.params:
        jsonschema.validate(bound[spec.name], spec.schema)


# --- the socket server ---------------------------------------------------------------------------

@pytest.fixture
async def server(short_tmp: Path) -> AsyncIterator[JsonRpcServer]:
    served = JsonRpcServer(registry(), short_tmp / "fuzz.sock", max_request_bytes=4096,
                           max_connections=8, idle_timeout=30.0)
    await served.start()
    yield served
    await served.close()


@given(st.lists(lines, min_size=1, max_size=4), st.sampled_from([b"\n", b"\r\n", b""]))
@fuzz_settings(scale=0.25)
@example([b"\xff\xfe\n", b"x" * 5000], b"\n")  # not UTF-8, then a line over the limit
async def test_server_answers_each_line_and_keeps_serving(server: JsonRpcServer, parts: list[bytes],
                                                          end: bytes) -> None:
    reader, writer = await asyncio.open_unix_connection(str(server.path))
    try:
        writer.write(b"".join(part.replace(b"\n", b" ") + end for part in parts))
        writer.write_eof()
        async with asyncio.timeout(10):
            while line := await reader.readline():  # until the server is done with us
                answer = orjson.loads(line)
                for one in answer if isinstance(answer, list) else [answer]:
                    check_answer(one)
    finally:
        writer.close()
    reader, writer = await asyncio.open_unix_connection(str(server.path))
    try:
        writer.write(b'{"jsonrpc": "2.0", "method": "t.add", "params": {"a": 41}, "id": 7}\n')
        async with asyncio.timeout(10):
            assert orjson.loads(await reader.readline()) == {"jsonrpc": "2.0", "result": 42, "id": 7}
    finally:
        writer.close()


async def test_a_batch_over_the_limit_is_one_error() -> None:
    fresh = registry()
    answer = orjson.loads(await fresh.dispatch(to_json([{"jsonrpc": "2.0", "method": "t.none", "id": i}
                                                        for i in range(fresh.max_batch + 1)])))
    assert answer["error"]["code"] == ErrorCode.INVALID_REQUEST
    assert "over the limit" in answer["error"]["data"]
    assert fresh.counters["error.batch_too_large"] == 1
    full = orjson.loads(await fresh.dispatch(to_json([{"jsonrpc": "2.0", "method": "t.none", "id": i}
                                                      for i in range(fresh.max_batch)])))
    assert len(full) == fresh.max_batch


async def test_a_result_too_deep_to_encode_is_an_error_for_its_request_only() -> None:
    """Found by review of what the fuzzer showed: orjson encodes 255 levels, a peer's DHT value
    may nest 1000 (dht.get returns it); the whole answer used to fail, and with it the connection."""
    fresh = registry()
    batch = [{"jsonrpc": "2.0", "method": "t.deep", "params": {"depth": 300}, "id": 1},
             {"jsonrpc": "2.0", "method": "t.add", "params": {"a": 1}, "id": 2}]
    first, second = orjson.loads(await fresh.dispatch(to_json(batch)))
    assert first["id"] == 1 and first["error"]["code"] == ErrorCode.INTERNAL_ERROR
    assert second == {"jsonrpc": "2.0", "result": 2, "id": 2}
    assert fresh.counters["error.unencodable_result"] == 1
