"""Workload config schemas and their validation (pure, no torch work)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dedloc.plugins import ConfigField, Workload, WorkloadConfigError
from dedloc.plugins.tiny import TINY


def make(**config: ConfigField) -> Workload:
    return dataclasses.replace(TINY, config=config)


WORKLOAD = make(
    lr=ConfigField(float, 0.1, "Learning rate.", minimum=0.0, maximum=1.0),
    steps=ConfigField(int, 10, "Steps.", minimum=1),
    name=ConfigField(str, "adam", "Optimizer.", choices=("adam", "sgd")),
    shuffle=ConfigField(bool, True, "Shuffle."),
)


def test_defaults_fill_what_is_missing() -> None:
    assert WORKLOAD.resolve_config({"steps": 3}) == {"lr": 0.1, "steps": 3, "name": "adam", "shuffle": True}
    assert WORKLOAD.resolve_config(None) == WORKLOAD.resolve_config({})


def test_int_is_accepted_for_float_and_converted() -> None:
    resolved = WORKLOAD.resolve_config({"lr": 1})
    assert resolved["lr"] == 1.0 and isinstance(resolved["lr"], float)


@pytest.mark.parametrize(("user", "key", "words"), [
    ({"lrr": 0.1}, "lrr", "unknown key"),
    ({"lr": "0.1"}, "lr", "expected a number"),
    ({"lr": True}, "lr", "expected a number"),
    ({"lr": math.nan}, "lr", "finite"),
    ({"lr": 2.0}, "lr", "above the maximum"),
    ({"steps": 1.5}, "steps", "expected an integer"),
    ({"steps": True}, "steps", "expected an integer"),
    ({"steps": 0}, "steps", "below the minimum"),
    ({"name": "adagrad"}, "name", "not one of"),
    ({"shuffle": 1}, "shuffle", "expected a boolean"),
])
def test_errors_name_the_key(user: dict[str, object], key: str, words: str) -> None:
    with pytest.raises(WorkloadConfigError) as caught:
        WORKLOAD.resolve_config(user)
    assert caught.value.key == key
    assert words in caught.value.reason
    assert caught.value.data == {"key": key, "reason": caught.value.reason}


def test_config_schema() -> None:
    schema = WORKLOAD.config_schema()
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert schema["properties"]["lr"] == {"type": "number", "default": 0.1, "description": "Learning rate.",
                                          "minimum": 0.0, "maximum": 1.0}
    assert schema["properties"]["steps"]["type"] == "integer"
    assert schema["properties"]["name"]["enum"] == ["adam", "sgd"]
    assert schema["properties"]["shuffle"] == {"type": "boolean", "default": True, "description": "Shuffle."}


def test_the_built_in_workload_is_valid() -> None:
    assert TINY.problems() == []
    assert TINY.resolve_config({})["classes"] == 4


@pytest.mark.parametrize(("change", "words"), [
    ({"name": "Not A Name"}, "name"),
    ({"api_version": 99}, "api_version 99"),
    ({"loss": None}, "loss must be callable"),
    ({"config": {"lr": ConfigField(float, "high", "x")}}, "config key 'lr': default"),
    ({"config": {"lr": ConfigField(list, [], "x")}}, "type must be one of"),
    ({"config": {"mode": ConfigField(str, "a", "x", choices=("b", "c"))}}, "not one of"),
    ({"config": {"bad-key": ConfigField(int, 1, "x")}}, "config key 'bad-key'"),
    ({"config": {"lr": 0.1}}, "not a ConfigField"),
])
def test_invalid_definitions_are_found(change: dict[str, object], words: str) -> None:
    problems = dataclasses.replace(TINY, **change).problems()
    assert any(words in problem for problem in problems), problems
