"""The simulator's structured output: a value for each schema of the documented subset that
validates against it, and `Unsatisfiable` for what it cannot answer."""

from __future__ import annotations

import json

import jsonschema  # installed with the dev extras (litellm needs it)
import pytest

from llmgw.simengine import structured

NODE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "label": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["label"],
        }
    },
    "$ref": "#/$defs/node",
}

ANSWERED = [
    {"type": "string"},
    {"type": "string", "minLength": 40},
    {"type": "string", "maxLength": 3},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "email"},
    {"type": "integer"},
    {"type": "integer", "minimum": 7, "multipleOf": 5},
    {"type": "integer", "exclusiveMaximum": -3},
    {"type": "integer", "minimum": 2, "maximum": 2},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "number", "maximum": -10},
    {"type": "boolean"},
    {"type": "null"},
    {"type": ["null", "integer"]},
    {"enum": ["a", "b"]},
    {"const": {"x": 1}},
    {"anyOf": [{"type": "string", "pattern": "x"}, {"type": "integer"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}}]},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 3},
    {"type": "array", "items": {"type": "number"}, "maxItems": 0},
    {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "boolean"}},
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": {"type": "integer"},
    },
    NODE,
    {"properties": {"deep": {"properties": {"er": {"items": {"type": "integer"}}}}}},
]


@pytest.mark.parametrize("schema", ANSWERED, ids=lambda s: json.dumps(s)[:60])
def test_the_answer_validates_against_its_schema(schema):
    text = structured.answer("json_schema", schema)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_an_empty_schema_answer_an_object():
    for text in (structured.answer("json_object"), structured.answer("json_schema", {})):
        assert isinstance(json.loads(text), dict)


REFUSED = [
    ({"type": "string", "pattern": "^a$"}, "'pattern' is not supported"),
    ({"not": {"type": "string"}}, "'not' is not supported"),
    ({"type": "integer", "minimum": 3, "maximum": 2}, "no integer"),
    ({"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 5}, "no integer"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number"),
    ({"enum": []}, "empty enum"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3"),
    ({"type": "array", "minItems": 2, "uniqueItems": True}, "uniqueItems"),
    (
        {"type": "object", "required": ["a"], "additionalProperties": False},
        "requires 'a'",
    ),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    ({"$ref": "other.json#/x"}, "only references within the schema"),
    ({"type": "tuple"}, "unknown type 'tuple'"),
    (
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"n": {"$ref": "#/$defs/n"}},
                    "required": ["n"],
                }
            },
            "$ref": "#/$defs/n",
        },
        "nests deeper",
    ),  # fmt: skip
    ({"anyOf": [{"pattern": "a"}, {"not": {}}]}, "'pattern' is not supported"),
]


@pytest.mark.parametrize("schema,why", REFUSED, ids=lambda s: json.dumps(s)[:60])
def test_a_schema_it_cannot_answer_is_refused_saying_why(schema, why):
    with pytest.raises(structured.Unsatisfiable) as err:
        structured.answer("json_schema", schema)
    assert why in str(err.value)


def test_numbers_are_near_one_and_a_half_inside_their_bounds():
    def number(**bounds):
        return json.loads(structured.answer("json_schema", {"type": "number", **bounds}))

    assert number() == 1.5
    assert number(minimum=0, maximum=100) == 1.5
    assert number(minimum=10, maximum=20) == 10
    assert number(exclusiveMinimum=10, maximum=20) == 15
    assert number(exclusiveMaximum=-4) == -5
    assert number(minimum=-1, maximum=1) == 1


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "exclusiveMinimum": 1.5},
        {"type": "number", "minimum": 1.5, "exclusiveMinimum": 1.5},
    ],
)
def test_an_open_bound_at_one_and_a_half_still_answers_a_json_number(schema):
    text = structured.answer("json_schema", schema)

    def not_json(constant: str):  # Python reads Infinity and NaN; JSON has neither
        raise AssertionError(f"{constant} is not JSON")

    jsonschema.validate(json.loads(text, parse_constant=not_json), schema)


@pytest.mark.parametrize(
    "schema", [{"type": "number", "minimum": "5"}, {"type": "string", "maxLength": None}]
)
def test_a_keyword_of_the_wrong_type_is_refused_not_a_crash(schema):
    with pytest.raises(structured.Unsatisfiable, match="malformed"):
        structured.answer("json_schema", schema)
