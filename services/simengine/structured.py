"""Structured output: the JSON a `response_format` asks for, as vLLM's guided decoding answers.

vLLM constrains decoding to a grammar, so its answer to `json_object` parses as a JSON object
and its answer to `json_schema` validates against the schema, until `max_tokens` cuts it
short: then the JSON is truncated and finish_reason is "length", as any answer's is. The
simulator has no model to constrain, so it builds one value from the schema instead,
deterministically, and answers its JSON text a few bytes a token like any other text.

What a schema may say (a subset: what pydantic models and hand-written schemas use):

- `type` (a list: its first type other than null), `enum` (the first value), `const`;
- objects: every property of `properties`, required or not (optional ones down to depth 4);
- arrays: `prefixItems`, then `items` up to `minItems` (one item when unset, down to depth 4),
  never more than `maxItems`;
- strings: `minLength`, `maxLength`, and `format` date-time, date, time, email, uri, uuid,
  ipv4, hostname (other formats are annotations and get plain text);
- integers and numbers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`,
  `multipleOf` (integers, and numbers with an integer multiple);
- `anyOf` / `oneOf` (the first branch it can build), `allOf` of one schema, `$ref` to a
  JSON pointer in the schema (`#/$defs/...`, `#/definitions/...`, `#`);
- annotations (`title`, `description`, `default`, `examples`, ...) are ignored.

A keyword that constrains values in a way not listed (`pattern`, `not`, `if`, `contains`,
`uniqueItems` with several items, ...) or a schema no value satisfies (a minimum above the
maximum, an empty enum, a required property that additionalProperties: false forbids) is
refused with `Unsatisfiable`, answered as a 400, as vLLM refuses a schema its grammar
backend cannot compile, rather than answering JSON that would not validate.
"""

from __future__ import annotations

import json
import math
from typing import Any

# What `json_object` gets: an object, as vLLM's grammar `{"type": "object"}` allows.
JSON_OBJECT = {"answer": "lorem ipsum dolor sit amet"}

# Optional properties and default array items stop at this depth, so a recursive schema
# (a tree of nodes) ends; past MAX_DEPTH only an infinitely required nesting gets there.
OPTIONAL_DEPTH = 4
MAX_DEPTH = 32

_UNSUPPORTED = (
    "pattern",
    "patternProperties",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "dependentRequired",
    "dependentSchemas",
    "minProperties",
    "maxProperties",
)

_FORMATS = {
    "date-time": "2024-01-01T00:00:00Z",
    "date": "2024-01-01",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "192.0.2.1",
    "hostname": "example.com",
}
_WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit".split()


class Unsatisfiable(Exception):
    """A schema the simulator cannot answer with a valid value; the message says why."""


def answer(kind: str, schema: Any = None) -> str:
    """The JSON text for `json_object` or `json_schema` (with its schema)."""
    if kind == "json_object":
        return json.dumps(JSON_OBJECT)
    if schema is None or schema == {}:
        return json.dumps(JSON_OBJECT)
    if not isinstance(schema, dict):
        raise Unsatisfiable("the schema must be a JSON object")
    try:
        value = _Builder(schema).value(schema, "#", 0)
    except (TypeError, ValueError) as exc:  # a keyword of the wrong type: "minimum": "5"
        raise Unsatisfiable(f"the schema is malformed: {exc}") from None
    # allow_nan=False: a value outside JSON (inf from an open bound) is a bug, not output.
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


class _Builder:
    def __init__(self, root: dict[str, Any]):
        self.root = root

    def value(self, schema: Any, where: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise Unsatisfiable(f"{where}: nests deeper than {MAX_DEPTH} levels")
        if schema is True or schema == {}:
            return "lorem ipsum"
        if not isinstance(schema, dict):
            raise Unsatisfiable(f"{where}: a schema must be an object or true")
        for key in _UNSUPPORTED:
            if key in schema:
                raise Unsatisfiable(f"{where}: '{key}' is not supported by the simulator")
        if "$ref" in schema:
            return self.value(self._resolve(schema["$ref"], where), schema["$ref"], depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            if not schema["enum"]:
                raise Unsatisfiable(f"{where}: an empty enum allows no value")
            return schema["enum"][0]
        if "allOf" in schema:
            if len(schema["allOf"]) != 1:
                raise Unsatisfiable(f"{where}: 'allOf' of several schemas is not supported")
            return self.value(schema["allOf"][0], f"{where}/allOf/0", depth + 1)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._first(schema[key], f"{where}/{key}", depth)
        kind = _type_of(schema, where)
        build = getattr(self, f"_{kind}", None)
        if build is None:
            raise Unsatisfiable(f"{where}: unknown type {kind!r}")
        return build(schema, where, depth)

    def _resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise Unsatisfiable(f"{where}: only references within the schema ('#/...') work")
        node: Any = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise Unsatisfiable(f"{where}: $ref {ref!r} points at nothing")
            node = node[part]
        return node

    def _first(self, branches: Any, where: str, depth: int) -> Any:
        if not isinstance(branches, list) or not branches:
            raise Unsatisfiable(f"{where}: must be a non-empty list")
        reasons = []
        for i, branch in enumerate(branches):
            try:
                return self.value(branch, f"{where}/{i}", depth + 1)
            except Unsatisfiable as exc:
                reasons.append(str(exc))
        raise Unsatisfiable("; ".join(reasons))

    def _object(self, schema: dict[str, Any], where: str, depth: int) -> dict[str, Any]:
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        out = {}
        for name, sub in props.items():
            if name in required or depth < OPTIONAL_DEPTH:
                out[name] = self.value(sub, f"{where}/properties/{name}", depth + 1)
        for name in required:
            if name in out:
                continue
            extra = schema.get("additionalProperties", True)
            if extra is False:
                raise Unsatisfiable(
                    f"{where}: requires {name!r}, which additionalProperties: false forbids"
                )
            out[name] = self.value(extra, f"{where}/additionalProperties", depth + 1)
        return out

    def _array(self, schema: dict[str, Any], where: str, depth: int) -> list[Any]:
        low = schema.get("minItems", 0)
        high = schema.get("maxItems", math.inf)
        if low > high:
            raise Unsatisfiable(f"{where}: minItems {low} is above maxItems {high}")
        count = min(max(low, 1 if depth < OPTIONAL_DEPTH else 0), high)
        if schema.get("uniqueItems") and count > 1:
            raise Unsatisfiable(f"{where}: uniqueItems with several items is not supported")
        prefix = schema.get("prefixItems") or []
        items = schema.get("items", {})
        out = []
        for i in range(int(count)):
            if i < len(prefix):
                out.append(self.value(prefix[i], f"{where}/prefixItems/{i}", depth + 1))
            elif items is False:
                raise Unsatisfiable(f"{where}: needs {count} items, and items: false allows none")
            else:
                out.append(self.value(items, f"{where}/items", depth + 1))
        return out

    def _string(self, schema: dict[str, Any], where: str, depth: int) -> str:
        low = schema.get("minLength", 0)
        high = schema.get("maxLength", math.inf)
        if low > high:
            raise Unsatisfiable(f"{where}: minLength {low} is above maxLength {high}")
        fixed = _FORMATS.get(schema.get("format", ""))
        if fixed is not None:
            if not low <= len(fixed) <= high:
                raise Unsatisfiable(
                    f"{where}: a {schema['format']} cannot be {low} to {high} characters"
                )
            return fixed
        text = "lorem ipsum"
        while len(text) < low:
            text += " " + _WORDS[len(text) % len(_WORDS)]
        return text if len(text) <= high else text[: int(high)]

    def _integer(self, schema: dict[str, Any], where: str, depth: int) -> int:
        step = schema.get("multipleOf", 1)
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            raise Unsatisfiable(f"{where}: multipleOf must be a positive integer here")
        low, high = _integer_bounds(schema)
        near = min(max(1, low), high)  # 1 if allowed, else the bound nearest it
        value = math.ceil(near / step) * step
        if value > high:
            value = math.floor(near / step) * step
        if not low <= value <= high:
            raise Unsatisfiable(f"{where}: no integer satisfies the bounds")
        return int(value)

    def _number(self, schema: dict[str, Any], where: str, depth: int) -> float | int:
        if "multipleOf" in schema:
            return self._integer(schema, where, depth)
        low, high = _bounds(schema)
        open_low, open_high = _open_low(schema), _open_high(schema)

        def inside(x: float) -> bool:
            above = low < x or x == low and not open_low
            return above and (x < high or x == high and not open_high)

        if inside(1.5):
            return 1.5
        near, other = (low, high) if 1.5 <= low else (high, low)
        if inside(near):
            return near
        # An open bound: step inside it.
        value = (near + other) / 2 if math.isfinite(other) else near + (1 if near == low else -1)
        if not inside(value):
            raise Unsatisfiable(f"{where}: no number satisfies the bounds")
        return value

    def _boolean(self, schema: dict[str, Any], where: str, depth: int) -> bool:
        return True

    def _null(self, schema: dict[str, Any], where: str, depth: int) -> None:
        return None


def _type_of(schema: dict[str, Any], where: str) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        if not kind:
            raise Unsatisfiable(f"{where}: an empty list of types allows no value")
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        if "properties" in schema or "required" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        return "string"
    if not isinstance(kind, str):
        raise Unsatisfiable(f"{where}: type must be a string or a list of strings")
    return kind


def _bounds(schema: dict[str, Any]) -> tuple[float, float]:
    low = max(schema.get("minimum", -math.inf), schema.get("exclusiveMinimum", -math.inf))
    high = min(schema.get("maximum", math.inf), schema.get("exclusiveMaximum", math.inf))
    return low, high


def _integer_bounds(schema: dict[str, Any]) -> tuple[float, float]:
    """The inclusive integer bounds (infinite where unbounded)."""
    low, high = -math.inf, math.inf
    if "minimum" in schema:
        low = math.ceil(schema["minimum"])
    if "exclusiveMinimum" in schema:
        low = max(low, math.floor(schema["exclusiveMinimum"]) + 1)
    if "maximum" in schema:
        high = math.floor(schema["maximum"])
    if "exclusiveMaximum" in schema:
        high = min(high, math.ceil(schema["exclusiveMaximum"]) - 1)
    return low, high


def _open_low(schema: dict[str, Any]) -> bool:
    return "exclusiveMinimum" in schema and schema["exclusiveMinimum"] >= schema.get(
        "minimum", -math.inf
    )


def _open_high(schema: dict[str, Any]) -> bool:
    return "exclusiveMaximum" in schema and schema["exclusiveMaximum"] <= schema.get(
        "maximum", math.inf
    )
