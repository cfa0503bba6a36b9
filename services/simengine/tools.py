"""Tool calls for the simulated model: which call a request gets, and its JSON arguments.

The decision, as vLLM with `--enable-auto-tool-choice` and a JSON tool parser makes it:
- `tool_choice` naming a function: a call to that function (vLLM ends it with "stop");
- "required": a call to the first tool (ends with "tool_calls");
- "auto" (or unset) with tools: a call to the first tool when the conversation's last turn is
  the user's, plain text once a tool result (or an assistant turn) came last, so an agent loop
  (call, run the tool, answer) ends as it would with a real model;
- "none", or no tools: plain text.

Arguments are made from the function's JSON schema, deterministically: every property in
`properties` gets a value of its type (the first `enum` value where there is one), nested
objects recursively. They parse as JSON and match the schema loosely, which is what clients
and agent frameworks check.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import msgspec

_encode = msgspec.json.encode

# Recursion bound for nested schemas; deeper objects become {}.
_MAX_DEPTH = 4


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    # vLLM: "stop" for a named tool_choice, "tool_calls" for "required" or "auto".
    finish_reason: str
    # Named or "required" (vLLM answers those with empty content), not "auto" (no content).
    forced: bool = True


class ToolChoiceError(ValueError):
    """A tool choice the request cannot have: the message names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def function_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """Names of the function tools, in order, from chat (`{"function": {...}}`) or Responses
    (flat `{"type": "function", "name": ...}`) shapes."""
    names = []
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if isinstance(name, str) and name:
            names.append(name)
    return names


def _parameters(tools: list[dict[str, Any]], name: str) -> Any:
    for tool in tools:
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if fn.get("name") == name:
            return fn.get("parameters")
    return None


def named_choice(tool_choice: Any) -> str | None:
    """The function a tool_choice names: chat `{"type": "function", "function": {"name"}}`
    or Responses `{"type": "function", "name"}`; None for the string choices."""
    if not isinstance(tool_choice, dict):
        return None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
    return name if isinstance(name, str) else None


def decide(
    tools: list[dict[str, Any]] | None, tool_choice: Any, last_role: str | None
) -> ToolCall | None:
    """The call this request makes, or None for a text answer. Raises ToolChoiceError."""
    names = function_names(tools)
    if tools is not None and not tools:
        raise ToolChoiceError(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    if tool_choice == "none":
        return None
    if tool_choice is not None and tools is None:
        raise ToolChoiceError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    named = named_choice(tool_choice)
    if isinstance(tool_choice, dict):
        if named is None:
            raise ToolChoiceError(
                "Expected field `name` in `function` in `tool_choice`! Correct usage: "
                '`{"type": "function", "function": {"name": "my_function"}}`',
                "tool_choice.function.name",
            )
        if named not in names:
            raise ToolChoiceError(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
        return ToolCall(named, arguments(_parameters(tools or [], named)), "stop")
    if tool_choice not in (None, "auto", "required"):
        raise ToolChoiceError(
            f"Invalid value for `tool_choice`: {tool_choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    if tool_choice == "required":
        if not names:
            raise ToolChoiceError("tool_choice 'required' needs a function tool", "tools")
        return ToolCall(names[0], arguments(_parameters(tools or [], names[0])), "tool_calls")
    if tool_choice in (None, "auto") and names and last_role == "user":
        args = arguments(_parameters(tools or [], names[0]))
        return ToolCall(names[0], args, "tool_calls", forced=False)
    return None


def arguments(schema: Any) -> str:
    """A JSON object string of values for the schema's properties."""
    value = _value(schema, "value", 0) if isinstance(schema, dict) else {}
    if not isinstance(value, dict):
        value = {}
    return _encode(value).decode()


def _value(schema: Any, name: str, depth: int) -> Any:
    if not isinstance(schema, dict):
        return "lorem"
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _value(options[0], name, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and isinstance(schema.get("properties"), dict)):
        props = schema.get("properties")
        if depth >= _MAX_DEPTH or not isinstance(props, dict):
            return {}
        return {str(k): _value(v, str(k), depth + 1) for k, v in props.items()}
    if kind == "array":
        return [_value(schema.get("items"), name, depth + 1)] if depth < _MAX_DEPTH else []
    if kind == "integer":
        return max(1, int(schema.get("minimum", 1)))
    if kind == "number":
        return float(schema.get("minimum", 1.5))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return f"{name} lorem"


def call_id() -> str:
    """vLLM's tool call id: `chatcmpl-tool-` and 16 hex digits."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}"
