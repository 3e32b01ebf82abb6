"""Connections from other users: a forked child takes other credentials, then connects.

The tests run as root (here and in CI), so a child can become any uid/gid; the server then sees
those credentials through SO_PEERCRED and SO_PEERGROUPS, exactly as it would see another user's.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import orjson

PING = b'{"jsonrpc": "2.0", "method": "ping", "params": {"n": 7}, "id": 1}\n'


def connect_as(path: Path, uid: int, gid: int, groups: list[int], request: bytes = PING) -> Any:
    """Fork a child that takes these credentials, connects to `path`, sends `request` and reads
    one answer line. Returns the parsed answer, or the name of the error the child got."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain system calls only, and it never returns into pytest
        code = 1
        try:
            os.close(read_end)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(20)
                sock.connect(str(path))
                sock.sendall(request)
                answer = b""
                while not answer.endswith(b"\n") and (chunk := sock.recv(65536)):
                    answer += chunk
            os.write(write_end, answer or b'"EOF"')
            code = 0
        except BaseException as exc:
            os.write(write_end, orjson.dumps(type(exc).__name__))
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return orjson.loads(data)


async def connect_as_async(path: Path, uid: int, gid: int, groups: list[int],
                           request: bytes = PING) -> Any:
    """`connect_as` while this event loop keeps serving."""
    return await asyncio.to_thread(connect_as, path, uid, gid, groups, request)
