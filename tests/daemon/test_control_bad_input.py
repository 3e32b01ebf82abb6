"""Hostile or clumsy clients on the control socket: each gets its error, the daemon serves on."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from dedloc.rpc import ErrorCode, RpcCallError


async def exchange(daemon, data: bytes) -> list[dict]:  # type: ignore[no-untyped-def]
    reader, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
    writer.write(data)
    await writer.drain()
    answers = []
    async with asyncio.timeout(30):
        while line := await reader.readline():
            answers.append(orjson.loads(line))
            if data.count(b"\n") <= len(answers):
                break
    writer.close()
    return answers


async def test_each_bad_request_gets_its_error(daemon) -> None:  # type: ignore[no-untyped-def]
    cases = [
        (b"this is not json\n", ErrorCode.PARSE_ERROR),
        (b"[1, 2]\n", ErrorCode.INVALID_REQUEST),
        (b'"a string"\n', ErrorCode.INVALID_REQUEST),
        (b'{"jsonrpc": "2.0", "method": "no.such", "id": 1}\n', ErrorCode.METHOD_NOT_FOUND),
        (b'{"jsonrpc": "2.0", "method": "run.status", "params": {"name": 5}, "id": 1}\n',
         ErrorCode.INVALID_PARAMS),
        (b'{"jsonrpc": "2.0", "method": "run.start", "params": {"workload": "tiny", '
         b'"target_batch_size": "big"}, "id": 1}\n', ErrorCode.INVALID_PARAMS),
        (b'{"jsonrpc": "2.0", "method": "run.stop", "params": {"name": "none"}, "id": 1}\n',
         ErrorCode.UNKNOWN_RUN),
    ]
    for request, code in cases:
        answers = await exchange(daemon, request)
        errors = [a["error"] for a in (answers[0] if isinstance(answers[0], list) else answers)]
        assert all(e["code"] == code for e in errors), (request, answers)
    bad_type = (await exchange(daemon, cases[5][0]))[0]["error"]
    assert bad_type["data"]["param"] == "target_batch_size"
    counters = (await daemon.call("node.info"))["counters"]
    assert counters["error.parse"] == 1
    assert counters["error.invalid_params"] >= 3


async def test_oversized_request_closes_only_that_connection(daemon) -> None:  # type: ignore[no-untyped-def]
    reader, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
    huge = b'{"jsonrpc": "2.0", "method": "node.info", "params": {"x": "' + b"x" * (2 << 20)
    writer.write(huge)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await writer.drain()
        async with asyncio.timeout(30):
            answer = await reader.readline()
            assert orjson.loads(answer)["error"]["code"] == ErrorCode.INVALID_REQUEST
            await reader.readexactly(1)  # then the connection is closed
    writer.close()
    info = await daemon.call("node.info")
    assert info["counters"]["error.request_too_large"] == 1


async def test_client_disconnecting_mid_request(daemon) -> None:  # type: ignore[no-untyped-def]
    for _ in range(3):
        _, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
        writer.write(b'{"jsonrpc": "2.0", "method": "node.')
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    info = await daemon.call("node.info")
    assert info["counters"]["error.incomplete_request"] == 3


async def test_application_errors_and_a_batch(daemon) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RpcCallError) as caught:
        await daemon.call("run.start", {"workload": "no-such-workload"})
    assert caught.value.code == ErrorCode.UNKNOWN_WORKLOAD
    with pytest.raises(RpcCallError) as caught:
        await daemon.call("run.start", {"workload": "tiny", "config": {"no_such_key": 1}})
    assert caught.value.code == ErrorCode.INVALID_WORKLOAD_CONFIG
    assert caught.value.data["key"] == "no_such_key"
    batch = orjson.dumps([{"jsonrpc": "2.0", "method": "node.info", "id": 1},
                          {"jsonrpc": "2.0", "method": "nope", "id": 2}]) + b"\n"
    (answer,) = await exchange(daemon, batch)
    by_id = {a["id"]: a for a in answer}
    assert "peer_id" in by_id[1]["result"]
    assert by_id[2]["error"]["code"] == ErrorCode.METHOD_NOT_FOUND
    assert (await daemon.call("run.status")) == []  # nothing half-started was left behind
