"""The Markdown reference rendered from an OpenRPC document, and docs/rpc-reference.md kept current."""

from __future__ import annotations

import asyncio
import difflib
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict

import pytest

from dedloc.daemon.reference import openrpc_in_process, render
from dedloc.rpc import ErrorCode, MethodRegistry, rpc_method
from dedloc.rpc.reference import anchor, render_reference, render_type

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "rpc-reference.md"
REGENERATE = "make docs"


@pytest.mark.parametrize(("schema", "text"), [
    ({}, "any"),
    ({"type": "string"}, "string"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "integer | null"),
    ({"enum": ["none", "fp16"]}, '"none" | "fp16"'),
    ({"anyOf": [{"enum": ["trainer", "aux"]}, {"type": "null"}]}, '"trainer" | "aux" | null'),
    ({"type": "array", "items": {"type": "string"}}, "string[]"),
    ({"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "(string | null)[]"),
    ({"type": "array"}, "any[]"),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}, "[string, integer]"),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, "object of integer"),
    ({"type": "object", "additionalProperties": {}}, "object"),
    ({"type": "object", "properties": {"a": {"type": "string"}}}, "object"),
    ({"type": ["string", "null"]}, "string | null"),
    ({"const": 3}, "3"),
])
def test_render_type(schema: dict[str, Any], text: str) -> None:
    assert render_type(schema) == text


def test_anchor_is_githubs() -> None:
    assert anchor("`run.start`") == "runstart"
    assert anchor("`node.set_bandwidth`") == "nodeset_bandwidth"
    assert anchor("Errors") == "errors"


class Inner(TypedDict):
    where: Annotated[str, "A path like <state_dir>/x."]


class Answer(TypedDict):
    total: Annotated[int, "The sum."]
    inner: Inner
    counts: dict[str, int]


class Api:
    @rpc_method("math.add", errors=(ErrorCode.UNKNOWN_RUN,))
    async def add(self, a: Annotated[int, "First term.", {"minimum": 1}],
                  mode: Annotated[Literal["plain", "double"], "How to add."] = "plain",
                  tags: list[str] | None = None) -> Answer:
        """Add two integers, a summary line that wraps
        onto a second line.

        More text, in a paragraph of its own.
        """
        return {"total": a, "inner": {"where": mode}, "counts": {}}


def test_render_reference_of_a_registry() -> None:
    registry = MethodRegistry("Toy API", "9.9", "A toy.")
    registry.register_object(Api())
    text = render_reference(registry.openrpc(), preamble="Hello <b>.", order=["math.add"])
    lines = text.splitlines()
    assert lines[0] == "# Toy API"
    assert "Hello <b>." in lines  # the preamble is Markdown, taken as it is
    # The index links every method, with the whole first sentence of its documentation.
    assert ("| [`math.add`](#mathadd) | Add two integers, a summary line that wraps onto a second "
            "line. |") in lines
    assert "| [`rpc.discover`](#rpcdiscover) |" in text
    # The method: documentation, parameters in order with types, defaults and constraints.
    section = text[text.index("### `math.add`"):text.index("### `rpc.discover`")]
    assert "Add two integers, a summary line that wraps onto a second line.\n\n" in section
    assert "More text, in a paragraph of its own." in section
    params = [line for line in section.splitlines() if line.startswith("- `")]
    assert params[:3] == [
        "- `a` (`integer`, required, ≥ 1): First term.",
        '- `mode` (`"plain" | "double"`, optional, default `"plain"`): How to add.',
        "- `tags` (`string[] | null`, optional, default `null`)",
    ]
    # The result's fields, nested ones indented; `<` escaped outside code.
    assert "**Result** (`object`)" in section
    assert "- `total` (`integer`): The sum." in section
    assert "  - `where` (`string`): A path like \\<state_dir>/x." in section
    assert "- `counts` (`object of integer`)" in section
    # Its errors, resolved to names and codes.
    assert ("**Errors**: [`INVALID_PARAMS`](#errors) (-32602), [`UNKNOWN_RUN`](#errors) (1004)."
            in section)
    # The error table holds every code.
    table = text[text.index("## Errors"):]
    for code in ErrorCode:
        assert f"| {int(code)} | `{code.name}` |" in table
    assert render_reference(registry.openrpc()) == render_reference(registry.openrpc())


async def reference_command(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dedloc.daemon.reference", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(120):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_committed_reference_is_current(short_tmp: Path) -> None:
    generated = short_tmp / "rpc-reference.md"
    code, _, err = await reference_command("--output", str(generated))
    assert code == 0, err
    now = generated.read_text()
    committed = COMMITTED.read_text() if COMMITTED.exists() else ""
    if committed != now:
        diff = "".join(list(difflib.unified_diff(
            committed.splitlines(keepends=True), now.splitlines(keepends=True),
            "docs/rpc-reference.md (committed)", "generated now", n=1))[:60])
        pytest.fail(f"docs/rpc-reference.md is stale: regenerate it with `{REGENERATE}` "
                    f"(python -m dedloc.daemon.reference --output docs/rpc-reference.md)\n{diff}",
                    pytrace=False)
    assert f"`{REGENERATE}`" in now  # the page says how it is regenerated
    # --check says so too, with the command.
    code, _, err = await reference_command("--check", str(generated))
    assert code == 0, err
    generated.write_text(now.replace("### `run.start`", "### `run.begin`"))
    code, _, err = await reference_command("--check", str(generated))
    assert code == 1 and "stale" in err and REGENERATE in err


async def test_reference_is_what_a_running_daemon_discovers(daemon: Any) -> None:
    """The in-process document (what `make docs` renders) is the one a real daemon serves."""
    served = await daemon.call("rpc.discover")
    assert served == openrpc_in_process()
    code, out, err = await reference_command("--socket", str(daemon.socket_path))
    assert code == 0, err
    assert out == render(served)
