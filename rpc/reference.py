"""A Markdown reference of a JSON-RPC API, rendered from its OpenRPC document (`rpc.discover`).

The input is the plain OpenRPC dict (as `MethodRegistry.openrpc()` builds it, or as a client reads
it from a server), so any server of ours, or a foreign one, can be documented the same way. The
output is deterministic: the same document gives the same text, byte for byte, so a committed copy
can be checked against the code.

Types are written the way the JSON looks, in a TypeScript-like notation: `string`, `integer`,
`number`, `boolean`, `null`, `any`, `T[]`, `object`, `object of T` (a map from strings to T),
`[A, B]` (a fixed-length array), `"a" | "b"` (one of these values), `A | B`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["anchor", "render_reference", "render_type"]

_CONSTRAINTS = (
    ("minimum", "≥ {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "≤ {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "at least {} characters"),
    ("maxLength", "at most {} characters"),
    ("minItems", "at least {} items"),
    ("maxItems", "at most {} items"),
    ("pattern", "matching `{}`"),
)


def render_type(schema: Mapping[str, Any]) -> str:
    """A JSON schema as a short, readable type, like `string | null` or `object of integer`."""
    return _type(schema, nested=False)


def _type(schema: Mapping[str, Any], nested: bool) -> str:
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    if "const" in schema:
        return _literal(schema["const"])
    if "enum" in schema:
        return _union([_literal(v) for v in schema["enum"]], nested)
    for key in ("anyOf", "oneOf"):
        if key in schema:  # a union in a union needs no parentheses
            return _union([_type(option, nested=False) for option in schema[key]], nested)
    kind = schema.get("type")
    if isinstance(kind, list):
        return _union([_type({**schema, "type": k}, nested=False) for k in kind], nested)
    if kind == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(_type(item, nested=False) for item in schema["prefixItems"]) + "]"
        items = schema.get("items")
        return f"{_type(items, nested=True) if items else 'any'}[]"
    if kind == "object" or (kind is None and ("properties" in schema
                                              or "additionalProperties" in schema)):
        values = schema.get("additionalProperties")
        if isinstance(values, Mapping) and values and not schema.get("properties"):
            return f"object of {_type(values, nested=True)}"
        return "object"
    if isinstance(kind, str):
        return kind
    return "any"


def _union(options: Iterable[str], nested: bool) -> str:
    """`A | B`; in parentheses where it is an array's items or a map's values (`nested`)."""
    unique: list[str] = []
    for option in options:
        if option not in unique:
            unique.append(option)
    text = " | ".join(unique)
    return f"({text})" if nested and len(unique) > 1 else text


def _literal(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _constraints(schema: Mapping[str, Any]) -> list[str]:
    found = [text.format(_number(schema[key])) for key, text in _CONSTRAINTS if key in schema]
    if schema.get("uniqueItems"):
        found.append("no duplicates")
    return found


def _number(value: Any) -> str:
    return _literal(value) if not isinstance(value, str) else value


def anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (backticks and dots dropped, spaces to '-')."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _inline(text: str) -> str:
    """Prose on one line (descriptions may hold line breaks from docstrings), `<` escaped outside
    code spans so that placeholders like <peer-id> are not taken for HTML tags."""
    return _escape(_oneline(text))


def _oneline(text: str) -> str:
    return " ".join(text.split())


def _escape(text: str) -> str:
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if i % 2 else part.replace("<", "\\<") for i, part in enumerate(parts))


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(text: str) -> str:
    """Prose for a Markdown table cell: one line, pipes escaped."""
    return _inline(text).replace("|", "\\|")


# --- fields of objects ------------------------------------------------------------------------------


def _fields(schema: Mapping[str, Any], indent: str, depth: int = 0) -> list[str]:
    """Bullet lines for the documented parts of `schema`: an object's properties, recursively, or
    the items of an array of such objects."""
    if depth > 8:  # self-similar schemas: stop rather than recurse forever
        return []
    if schema.get("type") == "array" and isinstance(schema.get("items"), Mapping):
        items = schema["items"]
        lines = []
        if items.get("description") and items.get("description") != schema.get("description"):
            lines.append(f"{indent}- each item: {_inline(items['description'])}")
            inner = _fields(items, indent + "  ", depth + 1)
        else:
            inner = _fields(items, indent, depth + 1)
        return lines + inner
    for key in ("anyOf", "oneOf"):
        if key in schema:  # `T | null`: document T's fields
            objects = [o for o in schema[key] if isinstance(o, Mapping) and o.get("properties")]
            if len(objects) == 1:
                return _fields(objects[0], indent, depth + 1)
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        return []
    required = set(schema.get("required", ()))
    lines = []
    for name, sub in properties.items():
        notes = []
        if name not in required:
            notes.append("may be absent")
        notes.extend(_constraints(sub))
        head = f"{indent}- {_code(name)} ({_code(render_type(sub))}{''.join(', ' + n for n in notes)})"
        description = sub.get("description")
        lines.append(f"{head}: {_inline(description)}" if description else head)
        lines.extend(_fields(sub, indent + "  ", depth + 1))
    return lines


# --- the document -------------------------------------------------------------------------------


def _error_index(doc: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    errors = doc.get("components", {}).get("errors", {})
    return {f"#/components/errors/{name}": {"name": name, **spec} for name, spec in errors.items()}


def _method_errors(method: Mapping[str, Any], index: Mapping[str, Mapping[str, Any]]
                   ) -> list[Mapping[str, Any]]:
    found = []
    for error in method.get("errors", ()):
        if "$ref" in error:
            resolved = index.get(error["$ref"])
            found.append(resolved or {"name": error["$ref"].rsplit("/", 1)[-1]})
        else:
            found.append(error)
    return found


def _render_param(param: Mapping[str, Any]) -> list[str]:
    schema = param.get("schema", {})
    notes = ["required" if param.get("required") else "optional"]
    if "default" in schema and not param.get("required"):
        notes.append(f"default {_code(_literal(schema['default']))}")
    notes.extend(_constraints(schema))
    description = param.get("description") or schema.get("description")
    head = f"- {_code(param['name'])} ({_code(render_type(schema))}, {', '.join(notes)})"
    lines = [f"{head}: {_inline(description)}" if description else head]
    lines.extend(_fields(schema, "  "))
    return lines


def _paragraphs(method: Mapping[str, Any]) -> list[str]:
    """The method's summary and description as paragraphs. A summary that stops mid-sentence (the
    first line of a docstring whose first sentence wraps) is joined with what follows it."""
    summary = _oneline(method.get("summary", ""))
    rest = [p.strip() for p in re.split(r"\n\s*\n", method.get("description", "")) if p.strip()]
    if summary and rest and not summary.endswith((".", "!", "?")):
        return [f"{summary} {_oneline(rest[0])}", *rest[1:]]
    return [p for p in (summary, *rest) if p]


def _first_sentence(method: Mapping[str, Any]) -> str:
    paragraphs = _paragraphs(method)
    if not paragraphs:
        return ""
    lead = _oneline(paragraphs[0])
    match = re.search(r"[.!?](\s|$)", lead)
    return lead[: match.start() + 1] if match else lead


def _render_method(method: Mapping[str, Any], index: Mapping[str, Mapping[str, Any]]) -> list[str]:
    name = method["name"]
    lines = [f"### {_code(name)}", ""]
    for paragraph in _paragraphs(method):
        lines += [_escape(paragraph), ""]
    params = method.get("params", [])
    if params:
        lines.append("**Parameters** (by name, or by position in this order):")
        lines.append("")
        for param in params:
            lines.extend(_render_param(param))
    else:
        lines.append("**Parameters**: none.")
    lines.append("")
    result = method.get("result", {})
    schema = result.get("schema", {})
    description = result.get("description") or schema.get("description")
    head = f"**Result** ({_code(render_type(schema))})"
    lines.append(f"{head}: {_inline(description)}" if description else head)
    fields = _fields(schema, "")
    if fields:
        lines += ["", *fields]
    lines.append("")
    errors = _method_errors(method, index)
    if errors:
        listed = ", ".join(
            f"[{_code(e['name'])}](#{anchor('errors')})" + (f" ({e['code']})" if "code" in e else "")
            for e in errors)
        lines += [f"**Errors**: {listed}.", ""]
    return lines


def render_reference(doc: Mapping[str, Any], *, title: str | None = None, preamble: str = "",
                     order: Sequence[str] | None = None) -> str:
    """The Markdown reference of the OpenRPC document `doc`.

    `title` replaces the document's own title as the page heading; `preamble` (Markdown) comes
    right after it; `order` lists method names to put first (the rest follow by name).
    """
    info = doc.get("info", {})
    methods = {m["name"]: m for m in doc.get("methods", [])}
    first = [n for n in (order or ()) if n in methods]
    names = first + sorted(n for n in methods if n not in first)
    index = _error_index(doc)

    lines = [f"# {title or info.get('title', 'JSON-RPC API')}", ""]
    if preamble.strip():
        lines += [preamble.strip(), ""]
    if info.get("description"):
        lines += [_inline(info["description"]), ""]

    lines += ["## Methods", "", "| method | what it does |", "|---|---|"]
    for name in names:
        heading = f"`{name}`"
        lines.append(f"| [{_cell(heading)}](#{anchor(heading)}) | {_cell(_first_sentence(methods[name]))} |")
    lines.append("")
    for name in names:
        lines.extend(_render_method(methods[name], index))

    lines += ["## Errors", "",
              "Every error answer is `{\"code\": int, \"message\": str, \"data\": any}`; `data` is "
              "optional. The codes are stable: switch on them, not on the message.", "",
              "| code | name | meaning |", "|---:|---|---|"]
    for spec in index.values():
        lines.append(f"| {spec.get('code', '')} | {_cell(_code(spec['name']))} | "
                     f"{_cell(spec.get('message', ''))} |")
    lines.append("")
    return "\n".join(lines)
