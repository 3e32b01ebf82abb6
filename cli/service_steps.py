"""The steps of `dedloc service install|uninstall`: each can describe itself (--dry-run) or be done.

Commands run with a timeout; a failure stops the installation with what went wrong and what to do.
Files are written atomically (a temporary file in the same folder, then renamed).
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

COMMAND_TIMEOUT = 60.0
NOLOGIN = "/usr/sbin/nologin"


class ServiceError(Exception):
    """What went wrong, and (hint) what to do about it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class Step(Protocol):
    def describe(self) -> str: ...

    def apply(self) -> None: ...


def describe_steps(verb: str, steps: list[Step]) -> str:
    lines = [f"dedloc service {verb} --dry-run: nothing is changed. The steps would be:"]
    for number, step in enumerate(steps, 1):
        lines.append(f"{number}. {step.describe()}")
    return "\n".join(lines) + "\n"


def apply_steps(steps: list[Step]) -> None:
    for step in steps:
        step.apply()


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run_command(argv: list[str], timeout: float = COMMAND_TIMEOUT, hint: str | None = None,
                required: bool = True) -> None:
    """Run a command; a failure raises ServiceError (or, when not `required`, is only reported)."""
    _say(f"$ {shlex.join(argv)}")
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                                stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise ServiceError(f"{argv[0]} is not installed", "dedloc service needs a systemd machine "
                           "with useradd (package passwd or shadow-utils)") from None
    except subprocess.TimeoutExpired:
        raise ServiceError(f"`{shlex.join(argv)}` did not finish within {timeout:g} s",
                           hint or "try it by hand to see what it waits for") from None
    if result.returncode == 0:
        return
    output = (result.stderr or result.stdout).strip()
    message = f"`{shlex.join(argv)}` failed (exit {result.returncode})" + (f": {output}" if output else "")
    if not required:
        _say(f"  (ignored: {message})")
        return
    if "not been booted with systemd" in output or "Failed to connect to bus" in output:
        hint = ("this machine (or container) does not run systemd: use --prefix to prepare an "
                "image, or run `dedlocd --config /etc/dedloc/dedlocd.toml` another way")
    raise ServiceError(message, hint)


def lookup_ids(user: str, prefix: Path) -> tuple[int, int] | None:
    """(uid, gid) of `user` in the system, or in <prefix>/etc/passwd for another root; None if absent."""
    if prefix == Path("/"):
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            return None
        return entry.pw_uid, entry.pw_gid
    for fields in _entries(prefix / "etc" / "passwd"):
        if len(fields) >= 4 and fields[0] == user:
            return int(fields[2]), int(fields[3])
    return None


def group_exists(group: str, prefix: Path) -> bool:
    if prefix == Path("/"):
        try:
            grp.getgrnam(group)
        except KeyError:
            return False
        return True
    return any(fields[0] == group for fields in _entries(prefix / "etc" / "group"))


def _entries(path: Path) -> list[list[str]]:
    try:
        return [line.split(":") for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _prefixed(argv: list[str], prefix: Path) -> list[str]:
    return argv if prefix == Path("/") else [argv[0], "--prefix", str(prefix), *argv[1:]]


@dataclass
class Command:
    argv: list[str]
    timeout: float = COMMAND_TIMEOUT
    required: bool = True  # False: a failure is reported and the next step goes on
    hint: str | None = None

    def describe(self) -> str:
        return f"$ {shlex.join(self.argv)}" + ("" if self.required else "   (a failure is ignored)")

    def apply(self) -> None:
        run_command(self.argv, self.timeout, self.hint, self.required)


@dataclass
class EnsureUser:
    """The service's system user and its group of the same name, unless the user exists."""

    user: str
    home: str
    prefix: Path = Path("/")

    def command(self) -> list[str]:
        return _prefixed(["useradd", "--system", "--user-group", "--home-dir", self.home,
                          "--shell", NOLOGIN, self.user], self.prefix)

    def describe(self) -> str:
        exists = lookup_ids(self.user, self.prefix) is not None
        return (f"create the system user and group {self.user!r} unless the user exists (it "
                f"{'does' if exists else 'does not'} now):\n   $ {shlex.join(self.command())}")

    def apply(self) -> None:
        if lookup_ids(self.user, self.prefix) is not None:
            _say(f"the user {self.user} exists")
            return
        run_command(self.command())


@dataclass
class EnsureNoUser:
    """Remove the service's user (and its group, when userdel leaves it)."""

    user: str
    prefix: Path = Path("/")

    def describe(self) -> str:
        return (f"remove the user and group {self.user!r} if they exist:\n"
                f"   $ {shlex.join(_prefixed(['userdel', self.user], self.prefix))}\n"
                f"   $ {shlex.join(_prefixed(['groupdel', self.user], self.prefix))}")

    def apply(self) -> None:
        if lookup_ids(self.user, self.prefix) is not None:
            run_command(_prefixed(["userdel", self.user], self.prefix))
        if group_exists(self.user, self.prefix):
            run_command(_prefixed(["groupdel", self.user], self.prefix))


@dataclass
class WriteFile:
    path: Path
    text: str = field(repr=False)
    mode: int = 0o644
    owner: str | None = None  # user and group (same name); None: root's
    prefix: Path = Path("/")  # where to look the owner up
    secret: bool = False  # never printed
    keep_old: bool = False  # an existing file that differs is kept as <name>.old

    def describe(self) -> str:
        owner = f", owner {self.owner}" if self.owner else ""
        head = f"write {self.path} (mode 0{self.mode:o}{owner})"
        if self.keep_old:
            head += f"; a different existing one is kept as {self.path.name}.old"
        if self.secret:
            return head + ": (a secret, not shown)"
        return head + ":\n" + "".join(f"   | {line}\n" for line in self.text.splitlines()).rstrip("\n")

    def apply(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        if self.keep_old and self.path.is_file() and self.path.read_text() != self.text:
            shutil.copy2(self.path, self.path.with_name(self.path.name + ".old"))
            _say(f"kept the previous {self.path.name} as {self.path.name}.old")
        ids = None
        if self.owner is not None:
            ids = lookup_ids(self.owner, self.prefix)
            if ids is None:
                raise ServiceError(f"the user {self.owner} does not exist (useradd failed?)")
        handle, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(handle, "w") as out:
                os.fchmod(out.fileno(), self.mode)
                if ids is not None:
                    os.fchown(out.fileno(), *ids)
                out.write(self.text)
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        _say(f"wrote {self.path}")


@dataclass
class Remove:
    path: Path
    missing_ok: bool = True

    def describe(self) -> str:
        return (f"remove {self.path}" + (" and all in it" if self.path.is_dir() else "")
                + (" if it exists" if self.missing_ok else ""))

    def apply(self) -> None:
        if self.path.is_dir() and not self.path.is_symlink():
            shutil.rmtree(self.path)
        elif self.path.exists() or self.path.is_symlink():
            self.path.unlink()
        elif not self.missing_ok:
            raise ServiceError(f"{self.path} does not exist")
        else:
            return
        _say(f"removed {self.path}")
