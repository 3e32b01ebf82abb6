"""Who may use a JSON-RPC server: local users by their kernel credentials, TCP clients by a token.

Unix sockets. The kernel tells a server who is at the other end of an accepted connection:
SO_PEERCRED gives the pid, uid and gid the client had when it called connect(), SO_PEERGROUPS its
supplementary groups at that moment. `LocalUsers` admits root, the server's own user and the
members of the server's group, which are the people the socket's file mode (0660) is meant to
let in. The second check keeps a loosened mode, or a socket in a directory others can reach, from
widening access.

TCP (loopback only). Every user of the machine can connect to a loopback port, so a TCP client
proves that it may read the token file (mode 0600, the daemon's user only): its first request
must be `rpc.authenticate` with that token (`TOKEN_METHOD`); the server compares in constant time.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import hmac
import ipaddress
import os
import pwd
import secrets
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .errors import RpcError

TOKEN_METHOD = "rpc.authenticate"
TOKEN_FILE_NAME = "rpc-token"
_TOKEN_MIN_CHARS = 16

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
# SO_PEERGROUPS (Linux 4.13) is missing from Python's socket module. 59 is its number where
# SO_PEERCRED is 17 (the asm-generic numbering of x86, arm, riscv, ...); elsewhere it is not used.
_SO_PEERGROUPS = 59 if getattr(socket, "SO_PEERCRED", None) == 17 else None
_GROUPS_BUFFER = 1024  # the most Python's getsockopt reads: 256 gids; more go through /proc


class AccessError(RpcError):
    """A token file or a listen address cannot be used; the message says what to do."""


class SocketLike(Protocol):
    """What the access checks need of a socket (a `socket.socket` or asyncio's TransportSocket)."""

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


@dataclass(frozen=True)
class PeerCredentials:
    """Who connected to a unix socket, as the kernel saw it at connect() time."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, sock: SocketLike) -> PeerCredentials:
        """The credentials of the peer of a connected unix socket; OSError if the kernel has none."""
        if not hasattr(socket, "SO_PEERCRED"):
            raise OSError(errno.ENOPROTOOPT, "SO_PEERCRED is not available on this platform")
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        return cls(*_CREDENTIALS.unpack(raw))


def peer_groups(sock: SocketLike, pid: int) -> frozenset[int] | None:
    """The supplementary groups of a unix socket's peer; None when they cannot be learned.

    SO_PEERGROUPS first: the kernel's copy from connect() time, which needs no /proc access (the
    systemd unit's ProtectProc=invisible hides other users' processes) and cannot be confused by a
    reused pid. /proc/<pid>/status only when the socket option is missing (kernels before 4.13)
    or the peer has more groups than one getsockopt call can read.
    """
    if _SO_PEERGROUPS is not None:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _GROUPS_BUFFER)
        except OSError:
            pass
        else:
            count = len(raw) // 4
            return frozenset(struct.unpack(f"{count}I", raw[:count * 4]))
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return groups_from_proc_status(text)


def groups_from_proc_status(text: str) -> frozenset[int] | None:
    """The `Groups:` line of a /proc/<pid>/status file; None if it has none."""
    for line in text.splitlines():
        if line.startswith("Groups:"):
            return frozenset(int(g) for g in line.split()[1:])
    return None


class LocalUsers:
    """Admits root, the server's user (uid) and members of its group (gid), by kernel credentials.

    A member is a peer whose gid is the group, or who has it among its supplementary groups: users
    are usually put in a group with `usermod -aG`, which makes it a supplementary group.
    """

    def __init__(self, uid: int | None = None, gid: int | None = None) -> None:
        self.uid = os.geteuid() if uid is None else uid
        self.gid = os.getegid() if gid is None else gid
        self.user_name = _user_name(self.uid)
        self.group_name = _group_name(self.gid)

    def admits(self, credentials: PeerCredentials, sock: SocketLike) -> bool:
        if credentials.uid in (0, self.uid) or credentials.gid == self.gid:
            return True
        groups = peer_groups(sock, credentials.pid)
        return groups is not None and self.gid in groups

    def refusal(self, credentials: PeerCredentials) -> str:
        """What a refused client is told: who was refused, who is admitted, and what to do."""
        user = f"{self.user_name} (uid {self.uid})" if self.user_name else f"uid {self.uid}"
        group = f"{self.group_name} (gid {self.gid})" if self.group_name else f"gid {self.gid}"
        return (f"uid {credentials.uid} may not use this control socket: it admits root, {user} "
                f"and members of group {group}. Add the user to that group (usermod -aG "
                f"{self.group_name or self.gid} USER, then log in again) or run the client as "
                f"{self.user_name or f'uid {self.uid}'}")

    def describe(self) -> str:
        """Who is admitted, for the logs."""
        return (f"root, uid {self.uid} ({self.user_name or '?'}), "
                f"group {self.gid} ({self.group_name or '?'})")


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return ""


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return ""


# Tokens ---------------------------------------------------------------------------------------


def tokens_match(given: str, expected: str) -> bool:
    """Compare a client's token with the server's in constant time."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                               expected.encode("utf-8", "surrogatepass"))


def load_or_create_token(path: Path) -> str:
    """The token in `path`, created (mode 0600, 256 random bits) if there is none yet.

    The file is kept across restarts so that clients keep working. One that others may read is
    refused: its token may be known, so it must be replaced (removing the file makes a new one).
    """
    try:
        return read_token(path, check_private=True)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)  # fails if another process created it meanwhile: theirs wins
    except FileExistsError:
        pass
    except OSError as exc:
        raise AccessError(f"cannot write the token file {path}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return read_token(path, check_private=True)


def read_token(path: Path, *, check_private: bool = False) -> str:
    """The token in `path` (FileNotFoundError if there is none; AccessError if it is unusable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:  # EACCES; ELOOP for a symbolic link
        raise AccessError(f"cannot read the token file {path}: {exc.strerror}; it is readable "
                          "by the daemon's user only (and root)") from exc
    with os.fdopen(fd, "r", encoding="ascii", errors="replace") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise AccessError(f"the token file {path} is not a regular file")
        if check_private and info.st_mode & 0o077:
            raise AccessError(
                f"the token file {path} has mode {stat.S_IMODE(info.st_mode):04o}: others may have "
                "read the token. Remove the file (a new token is made at the next start) or, if "
                "nobody else could read it, chmod 600 it")
        if check_private and info.st_uid != os.geteuid():
            raise AccessError(f"the token file {path} belongs to uid {info.st_uid}, not to the "
                              f"daemon's uid {os.geteuid()}; remove it or chown it")
        token = handle.read(4096).strip()
    if len(token) < _TOKEN_MIN_CHARS or not token.isascii() or not token.isprintable():
        raise AccessError(f"the token file {path} holds no valid token (at least "
                          f"{_TOKEN_MIN_CHARS} printable characters); remove it to make a new one")
    return token


# Addresses ------------------------------------------------------------------------------------


def parse_host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `[IPV6]:PORT` as (host, port); ValueError saying what is wrong."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT (like 127.0.0.1:7300 or [::1]:7300)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 0 to 65535")
    return host, int(port_text)


CONTROL_API_EXPOSURE = ("the control API gives full control of the daemon and must never be "
                        "reachable from the network")


def loopback_address(text: str, exposure: str = CONTROL_API_EXPOSURE) -> tuple[str, int]:
    """`HOST:PORT` whose host is a loopback IP literal; ValueError (a clear message) otherwise.
    `exposure` says, in the message, why the listener must stay on loopback.

    Names such as `localhost` are refused: what they resolve to is not the daemon's to decide.
    """
    host, port = parse_host_port(text)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address; give a loopback address such as "
                         "127.0.0.1:PORT or [::1]:PORT") from None
    if not address.is_loopback:
        raise ValueError(f"{host} is not a loopback address: {exposure}. Listen on "
                         "127.0.0.1:PORT or [::1]:PORT, and use an SSH tunnel to reach it from "
                         "another machine")
    return str(address), port


__all__ = [
    "TOKEN_FILE_NAME",
    "TOKEN_METHOD",
    "AccessError",
    "LocalUsers",
    "PeerCredentials",
    "groups_from_proc_status",
    "load_or_create_token",
    "loopback_address",
    "parse_host_port",
    "peer_groups",
    "read_token",
    "tokens_match",
]
