"""The simulator's chat prompt, rendered one way for everyone who needs its bytes.

The simulator tokenizes the prompt it renders from a chat (its bytes are its tokens),
and a router scoring a simulator's cached blocks must render the very same bytes, or
no hash after the first differing byte matches. So the rules live here, in one place
both import (the router never imports the simulator):

- a message's text is its content's text parts joined by newlines (empty parts and
  non-text parts such as images dropped), then the JSON of an assistant message's
  `tool_calls`, as the history carries them back;
- turns are wrapped in a ChatML-like template, ending with the assistant's opening.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

_encode = msgspec.json.encode

# Part types whose text is prompt text: chat's "text" and the Responses API's
# input_text / output_text. Images, audio and files have no simulated cost.
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _part_text(part: Any) -> str | None:
    if isinstance(part, dict):
        kind, text = part.get("type"), part.get("text")
    else:
        kind, text = getattr(part, "type", None), getattr(part, "text", None)
    if kind in TEXT_PARTS and isinstance(text, str) and text:
        return text
    return None


def content_text(content: Any) -> str | None:
    """The text of a message's content (a string, a list of parts, or None), or None
    where content is neither a string nor a list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(t for p in content if (t := _part_text(p)) is not None)
    return None


def message_text(content: Any, tool_calls: Any = None) -> str:
    """One turn's text: its content's text, then its tool calls' JSON if it has any."""
    text = content_text(content) or ""
    if tool_calls:
        text += _encode(tool_calls).decode()
    return text


def render_chat(messages: Sequence[tuple[str, str]]) -> bytes:
    """A ChatML-like template: stable, so a shared system prompt is a shared byte prefix."""
    parts = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
    parts.append("<|im_start|>assistant\n")
    return "".join(parts).encode()


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """Token-id prompts as bytes: 4 per id, so the byte rules above count them exactly."""
    return array("I", ids).tobytes()
