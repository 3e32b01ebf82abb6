"""JSON Schema from Python type hints, and validation of call parameters against it.

One source of truth: a method's signature gives the schema that validates its parameters and that
`rpc.discover` publishes. Supported hints: str, int, float, bool, None, Any, Literal, unions,
list[T], dict[str, T], TypedDict, and `Annotated[T, "description", {extra schema}]`.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from .errors import InvalidParams

# Parameters nested deeper are refused: jsonschema's messages repr() the value (RecursionError near
# 1000 levels) and orjson encodes at most 255 levels; no method needs more than a few.
MAX_PARAM_DEPTH = 128

_SCALARS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
}


def schema_of(hint: Any) -> tuple[dict[str, Any], str | None]:
    """The JSON schema of a type hint and the description attached with `Annotated`, if any."""
    description: str | None = None
    if typing.get_origin(hint) is typing.Annotated:
        base, *extras = typing.get_args(hint)
        schema, description = schema_of(base)
        schema = dict(schema)
        for extra in extras:
            if isinstance(extra, str):
                description = extra
            elif isinstance(extra, Mapping):
                schema.update(extra)
        if description:
            schema["description"] = description
        return schema, description
    return _plain_schema(hint), description


def _plain_schema(hint: Any) -> dict[str, Any]:
    if hint is Any or hint is object:
        return {}
    if hint in _SCALARS:
        return dict(_SCALARS[hint])
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.NotRequired, typing.Required):  # a TypedDict key's marker
        return schema_of(args[0])[0]
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [schema_of(arg)[0] for arg in args]
        return {"anyOf": options}
    if origin in (list, tuple, typing.Sequence) or hint in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return {"type": "array", "prefixItems": [schema_of(a)[0] for a in args],
                    "minItems": len(args), "maxItems": len(args)}
        return {"type": "array", "items": schema_of(args[0])[0]} if args else {"type": "array"}
    if origin in (dict, typing.Mapping, Mapping) or hint is dict:
        if len(args) == 2:
            return {"type": "object", "additionalProperties": schema_of(args[1])[0]}
        return {"type": "object"}
    if typing.is_typeddict(hint):
        hints = typing.get_type_hints(hint, include_extras=True)
        properties = {name: schema_of(sub)[0] for name, sub in hints.items()}
        required = sorted(hint.__required_keys__)
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        if required:
            schema["required"] = required
        if hint.__doc__:
            schema["title"] = hint.__name__
        return schema
    raise TypeError(f"no JSON schema for type hint {hint!r}")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a JSON-RPC method."""

    name: str
    schema: dict[str, Any]
    required: bool
    default: Any = None
    description: str | None = None

    def to_openrpc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "required": self.required, "schema": self.schema}
        if self.description:
            doc["description"] = self.description
        return doc


@dataclass(frozen=True)
class Signature:
    """The parameters and result of a method, read from its type hints."""

    params: tuple[ParamSpec, ...]
    result: dict[str, Any]
    _validator: Any = field(repr=False, compare=False, default=None)

    @classmethod
    def of(cls, func: Callable[..., Any]) -> Signature:
        hints = typing.get_type_hints(func, include_extras=True)
        params = []
        for name, parameter in inspect.signature(func).parameters.items():
            if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            if name not in hints:
                raise TypeError(f"{func.__qualname__}: parameter {name!r} has no type hint")
            schema, description = schema_of(hints[name])
            required = parameter.default is inspect.Parameter.empty
            default = None if required else parameter.default
            if not required:
                schema = {**schema, "default": default}
            params.append(ParamSpec(name, schema, required, default, description))
        result = schema_of(hints.get("return", Any))[0]
        object_schema = {
            "type": "object",
            "properties": {p.name: p.schema for p in params},
            "required": [p.name for p in params if p.required],
            "additionalProperties": False,
        }
        validator = jsonschema.Draft202012Validator(object_schema)
        return cls(tuple(params), result, validator)

    def bind(self, args: list[Any] | None, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """Check JSON-RPC params (by position or by name); raise InvalidParams naming the culprit."""
        if args:
            if len(args) > len(self.params):
                raise InvalidParams(None, f"takes at most {len(self.params)} positional parameters, "
                                          f"got {len(args)}")
            given = {spec.name: value for spec, value in zip(self.params, args, strict=False)}
        else:
            given = dict(kwargs or {})
        for name, value in given.items():
            if _deeper_than(value, MAX_PARAM_DEPTH):
                raise InvalidParams(name, f"nested deeper than {MAX_PARAM_DEPTH} levels")
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(given))
        if error is not None:
            raise InvalidParams(_culprit(error), _reason(error))
        return {spec.name: given.get(spec.name, spec.default) for spec in self.params}


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels in `value` (without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _culprit(error: jsonschema.ValidationError) -> str | None:
    if error.absolute_path:
        return str(error.absolute_path[0])
    if error.validator == "required":
        return _first_quoted(error.message)
    if error.validator == "additionalProperties":
        return _first_quoted(error.message)
    return None


def _reason(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        return "unknown parameter"
    if error.validator == "required":
        return "missing required parameter"
    where = "".join(f"[{p!r}]" for p in list(error.absolute_path)[1:])
    return f"{where}: {error.message}" if where else error.message


def _first_quoted(message: str) -> str | None:
    start = message.find("'")
    end = message.find("'", start + 1)
    return message[start + 1 : end] if 0 <= start < end else None
