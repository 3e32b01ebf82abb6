"""Strategies for what a client writes on a JSON-RPC socket (import as `fuzz.rpcwire`).

A line is a request object with each member right, wrong or missing, a batch (the empty one, and
batches of batches too), bytes that are not JSON, or a request cut short.
"""

from __future__ import annotations

from typing import Any

from fuzz.fuzzutil import texts, to_json, wire_values
from hypothesis import strategies as st

ids = st.one_of(st.integers(-(2**63), 2**63 - 1), texts, st.none(), wire_values)


def params(names: list[str], shaped: st.SearchStrategy[Any] | None = None) -> st.SearchStrategy[Any]:
    """By name (some of `names`, any values), `shaped` (params that get further), by position, or
    not a container at all."""
    options = [st.fixed_dictionaries({}, optional={name: wire_values for name in names}),
               st.lists(wire_values, max_size=6), wire_values]
    return st.one_of(*options, *([shaped] if shaped is not None else []))


@st.composite
def requests(draw: st.DrawFn, methods: st.SearchStrategy[Any], param_values: st.SearchStrategy[Any]) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(wire_values)
    request: dict[str, Any] = {}
    fields = {"jsonrpc": st.one_of(st.just("2.0"), wire_values), "method": methods,
              "params": param_values, "id": ids}
    for name, strategy in fields.items():
        if draw(st.integers(0, 4)):  # usually present
            request[name] = draw(strategy)
    if draw(st.integers(0, 9)) == 0:
        request[draw(texts)] = draw(wire_values)
    return request


def lines(methods: st.SearchStrategy[Any], param_values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """One line's worth of bytes (without the newline)."""
    one = requests(methods, param_values)
    return st.one_of(
        one.map(to_json),
        st.lists(one, min_size=0, max_size=5).map(to_json),  # batches, the empty one too
        st.lists(st.lists(one, max_size=2), min_size=1, max_size=2).map(to_json),  # nested
        st.binary(max_size=200),
        one.map(to_json).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),  # cut short
    )
