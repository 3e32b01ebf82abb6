"""The dashboard's HTTP server on its own: what it serves, what it refuses, and that it keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dedloc.daemon.config import ConfigError, build_config
from dedloc.daemon.web import HttpServer, Response, loopback_listen_address


async def _hello() -> Response:
    return Response(200, b"hello", "text/plain")


async def _slow() -> Response:
    await asyncio.sleep(30)
    return Response(200, b"late")


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    server = HttpServer("127.0.0.1:0", {"/": _hello, "/slow": _slow}, max_request_bytes=2048,
                        read_timeout=0.5, handler_timeout=0.5)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def _host(server: HttpServer) -> str:
    assert server.address is not None
    return f"127.0.0.1:{server.address[1]}"


async def exchange(server: HttpServer, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read the whole answer: (status, headers, body)."""
    assert server.address is not None
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(10):
            answer = await reader.read()
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split(" ")[1]), headers, body


def get(server: HttpServer, path: str, method: str = "GET", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: {_host(server)}\r\n{extra}\r\n".encode()


async def test_serves_a_route_with_no_store_and_closes(server: HttpServer) -> None:
    status, headers, body = await exchange(server, get(server, "/"))
    assert (status, body) == (200, b"hello")
    assert headers["cache-control"] == "no-store"
    assert headers["connection"] == "close" and headers["content-length"] == "5"
    assert headers["x-content-type-options"] == "nosniff"
    assert "default-src 'none'" in headers["content-security-policy"]
    status, _, body = await exchange(server, get(server, "/?x=1"))  # the query is ignored
    assert (status, body) == (200, b"hello")
    status, headers, body = await exchange(server, get(server, "/", "HEAD"))
    assert (status, body, headers["content-length"]) == (200, b"", "5")
    assert server.url == f"http://{_host(server)}/"


@pytest.mark.parametrize("path", ["/nope", "/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd",
                                  "//etc/passwd", "/page.html/.."])
async def test_unknown_paths_are_404_and_nothing_is_read_from_disk(server: HttpServer, path: str) -> None:
    status, headers, body = await exchange(server, get(server, path))
    assert status == 404 and b"Not Found" in body
    assert headers["cache-control"] == "no-store"


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "OPTIONS", "TRACE", "CONNECT"])
async def test_other_methods_are_405_with_allow(server: HttpServer, method: str) -> None:
    status, headers, _ = await exchange(server, get(server, "/", method))
    assert status == 405
    assert headers["allow"] == "GET, HEAD"


async def test_an_oversized_request_is_refused_and_the_server_goes_on(server: HttpServer) -> None:
    huge = get(server, "/", extra="X-Filler: " + "a" * 100_000 + "\r\n")
    status, _, body = await exchange(server, huge)
    assert status == 431 and b"2048" in body
    status, _, _ = await exchange(server, get(server, "/"))
    assert status == 200
    assert server.counters["error.431"] == 1


async def test_bad_requests(server: HttpServer) -> None:
    cases = {
        b"GET /\r\n\r\n": 400,  # HTTP/0.9 style
        b"GET / HTTP/2.0\r\nHost: x\r\n\r\n": 505,
        b"GET / HTTP/1.1\r\n\r\n": 400,  # no Host
        get(server, "/", extra="Content-Length: 3\r\n") + b"abc": 400,  # a body
        get(server, "/", extra="Transfer-Encoding: chunked\r\n"): 400,
        get(server, "/", extra="broken header line\r\n"): 400,
        b"GET http://example.com/ HTTP/1.1\r\nHost: " + _host(server).encode() + b"\r\n\r\n": 400,
        "GET /é HTTP/1.1\r\n\r\n".encode(): 400,
    }
    for request, expected in cases.items():
        status, _, _ = await exchange(server, request)
        assert status == expected, request


async def test_another_host_header_is_refused(server: HttpServer) -> None:
    """A page elsewhere that rebinds its name to 127.0.0.1 still sends its own name as Host."""
    port = _host(server).split(":")[1]
    request = f"GET / HTTP/1.1\r\nHost: evil.example:{port}\r\n\r\n".encode()
    status, _, _ = await exchange(server, request)
    assert status == 403
    status, _, _ = await exchange(server, f"GET / HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n".encode())
    assert status == 200
    status, _, _ = await exchange(server, b"GET / HTTP/1.0\r\n\r\n")  # HTTP/1.0 needs none
    assert status == 200


async def test_silent_clients_and_slow_answers_time_out(server: HttpServer) -> None:
    status, _, _ = await exchange(server, b"GET / HTTP/1.1\r\n")  # never finishes its head
    assert status == 408
    status, _, _ = await exchange(server, get(server, "/slow"))
    assert status == 503
    assert server.counters["error.408"] == 1 and server.counters["error.503"] == 1


async def test_a_client_that_hangs_up_does_not_stop_the_server(server: HttpServer) -> None:
    assert server.address is not None
    for _ in range(5):
        _, writer = await asyncio.open_connection(*server.address)
        writer.write(b"GET / HT")
        writer.close()
    status, _, _ = await exchange(server, get(server, "/"))
    assert status == 200


@pytest.mark.parametrize("address", ["0.0.0.0:8470", "192.0.2.1:80", "[::]:8470", "localhost:8470",
                                     "example.com:80", "127.0.0.1", "127.0.0.1:99999"])
async def test_non_loopback_listen_addresses_are_refused(address: str) -> None:
    with pytest.raises(ValueError):
        loopback_listen_address(address)
    with pytest.raises(ValueError):
        await HttpServer(address, {}).start()
    with pytest.raises(ConfigError) as caught:
        build_config({"dashboard": {"listen": address}})
    assert caught.value.key == "dashboard.listen"


async def test_ipv6_loopback() -> None:
    server = HttpServer("[::1]:0", {"/": _hello})
    try:
        await server.start()
    except OSError as exc:  # a machine without IPv6
        pytest.skip(f"no IPv6 loopback: {exc}")
    try:
        assert server.url is not None and server.url.startswith("http://[::1]:")
        assert server.address is not None
        port = server.address[1]
        status, _, body = await exchange(server, f"GET / HTTP/1.1\r\nHost: [::1]:{port}\r\n\r\n".encode())
        assert (status, body) == (200, b"hello")
    finally:
        await server.close()


def test_the_dashboard_is_off_by_default() -> None:
    assert build_config().dashboard.listen == ""
    assert build_config({"dashboard": {"listen": "127.0.0.1:0"}}).dashboard.listen == "127.0.0.1:0"
