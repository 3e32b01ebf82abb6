"""Strategies and helpers shared by the fuzz tests (import as `fuzz.fuzzutil`).

The values are what can arrive on the wire: every JSON value orjson decodes (integers within
-2**63..2**64-1, finite floats, text without lone surrogates, nesting up to orjson's depth limit),
biased towards the keys and the shapes our protocols use, and towards edge values.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import InvalidArgument

from dedloc.daemon.identity import Identity

PROFILE = "dedloc-fuzz"  # registered by tests/fuzz/conftest.py
DEFAULT_EXAMPLES = 200

#: What a peer id looks like, and texts that are almost one.
PEER_IDS = [Identity.generate().peer_id for _ in range(3)]

EDGE_INTS = [0, 1, -1, 2, 63, 64, 65, 255, 256, 1023, 1024, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1,
             2**32, 2**53, 2**63 - 1, -(2**63), 2**64 - 1]
EDGE_FLOATS = [0.0, -0.0, 0.5, -1.5, 1e-300, 1e300, -1e300, 1.7976931348623157e308]


class Deep(list):  # type: ignore[type-arg]
    """A list nested `depth` deep (lists and objects in turn): what breaks recursive code. Its
    repr is short, so that hypothesis can print a failing example that holds one."""

    def __init__(self, depth: int, leaf: Any = None) -> None:
        value = leaf
        for level in range(depth - 1):
            value = [value] if level % 2 else {"k": value}
        super().__init__([value])
        self.depth = depth
        self.leaf = leaf

    def __repr__(self) -> str:
        return f"Deep({self.depth}, {self.leaf!r})"


def to_json(value: Any) -> bytes:
    """JSON bytes of any JSON-able value, however deep (orjson and json stop at a depth limit)."""
    out: list[bytes] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, bytes):  # a piece of punctuation pushed below
            out.append(item)
        elif isinstance(item, list):
            stack.append(b"]")
            for index in reversed(range(len(item))):
                stack.append(item[index])
                if index:
                    stack.append(b",")
            out.append(b"[")
        elif isinstance(item, dict):
            stack.append(b"}")
            pairs = list(item.items())
            for index in reversed(range(len(pairs))):
                key, sub = pairs[index]
                stack.append(sub)
                stack.append(orjson.dumps(str(key)) + b":")
                if index:
                    stack.append(b",")
            out.append(b"{")
        else:
            out.append(orjson.dumps(item))
    return b"".join(out)


@contextmanager
def daemon_recursion_limit() -> Iterator[None]:
    """Run with the stack headroom of a daemon (Python's default limit of 1000 frames above a
    shallow base), not the larger limit hypothesis sets while it runs a test: deep JSON that a
    daemon chokes on must choke here too."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 950)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def register_profile() -> None:
    """The fuzz tests' settings (see tests/fuzz/conftest.py): DEDLOC_FUZZ_EXAMPLES examples a test
    (default 200), no deadline; in CI (CI set) the same examples every run and no database, else
    failing examples kept under the temporary directory and tried first next time."""
    in_ci = bool(os.environ.get("CI"))
    settings.register_profile(
        PROFILE,
        max_examples=int(os.environ.get("DEDLOC_FUZZ_EXAMPLES") or DEFAULT_EXAMPLES),
        deadline=None,
        derandomize=in_ci,
        database=None if in_ci else DirectoryBasedExampleDatabase(
            Path(tempfile.gettempdir()) / "dedloc-fuzz-examples"),
        print_blob=True,
        # One transport or daemon serves every example of a test on purpose (state accumulates,
        # as on a real peer); inputs are big on purpose.
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


def fuzz_settings(scale: float = 1.0) -> settings:
    """The fuzz profile, with `scale` times its examples (at least 5)."""
    try:
        base = settings.get_profile(PROFILE)
    except InvalidArgument:  # imported without tests/fuzz/conftest.py (e.g. from another folder)
        register_profile()
        base = settings.get_profile(PROFILE)
    return settings(base, max_examples=max(5, int(base.max_examples * scale)))


ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**64 - 1), st.integers(-3, 70))
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=False, allow_infinity=False))
texts = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", " ", "0", "-1", "\u0000", "é", "\U0001f600", "../", "/"]),
    st.sampled_from(PEER_IDS),
    st.sampled_from(PEER_IDS).map(lambda p: p[:-1]),  # one character short
    st.sampled_from(PEER_IDS).map(lambda p: p + "1"),
    st.text("0123456789abcdefABCDEF", min_size=0, max_size=130),  # hex, of any length
    st.integers(0, 2**256 - 1).map(lambda n: f"{n:064x}"),
    st.integers(0, 2**512 - 1).map(lambda n: f"{n:0128x}"),
    st.sampled_from(["/ip4/127.0.0.1/tcp/1", "/ip4/1.2.3.4/tcp/65535/p2p/" + PEER_IDS[0],
                     "/ip6/::1/udp/0", "/dns/example.org/tcp/4100", "/ip4/300.1.1.1/tcp/1",
                     "/ip4/1.2.3.4/tcp/99999", "/ip4/1.2.3.4/tcp/1/p2p/" + PEER_IDS[0]
                     + "/p2p-circuit/p2p/" + PEER_IDS[1]]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(texts, children, max_size=5),
    max_leaves=20,
)
#: Mostly ordinary values, now and then one nested close to orjson's depth limit (1024).
wire_values = st.one_of(
    json_values,
    st.builds(Deep, st.one_of(st.integers(1, 40), st.integers(900, 1015)), scalars),  # room to wrap
)


def headers(keys: list[str], *, extra: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with some of `keys` (the fields a decoder reads) and, with `extra`, other keys."""
    known = st.fixed_dictionaries({}, optional={key: wire_values for key in keys})
    if not extra:
        return known
    return st.builds(lambda a, b: {**b, **a}, known, st.dictionaries(texts, wire_values, max_size=3))


def wire_json(value: Any) -> Any:
    """`value` as it comes out of orjson (what a decoder is handed after the wire)."""
    return orjson.loads(to_json(value))
