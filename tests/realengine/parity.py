"""Comparing two engines' answers to the same request by shape, field by field.

The sim and a random-weight vLLM never say the same words, so values are not compared;
what clients depend on is: which fields exist, their JSON types, and a few values that
carry meaning (object kinds, roles, finish reasons, event types and their order). A stream is
folded into one "union shape" per kind of event (every field any chunk had, with every type
it took), so the random length of an answer does not change what is compared.

A difference is one of:
- "null-only": a field one side sends as null and the other omits (clients can't tell);
- "missing in sim" / "only in sim": a field with a value on one side only;
- "type": a field whose JSON types differ;
- "value": a meaningful value that differs.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from typing import Any

NULL = "null"


def kind_of(value: Any) -> str:
    if value is None:
        return NULL
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


def shape(value: Any) -> Any:
    """Dicts keep their keys, lists merge their elements, scalars become sets of kinds."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        merged: Any = None
        for item in value:
            merged = merge(merged, shape(item))
        return [merged] if value else []
    return frozenset({kind_of(value)})


def merge(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out.get(k), v)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if not a:
            return b
        if not b:
            return a
        return [merge(a[0], b[0])]
    if isinstance(a, frozenset) and isinstance(b, frozenset):
        return a | b
    # A field that is an object in one place and null (or a list) in another.
    return frozenset(_kinds(a) | _kinds(b))


def _kinds(s: Any) -> set[str]:
    if isinstance(s, frozenset):
        return set(s)
    if isinstance(s, dict):
        return {"object"}
    return {"list"}


@dataclass(frozen=True)
class Difference:
    case: str
    path: str
    kind: str
    detail: str

    def key(self) -> str:
        return f"{self.case}:{self.path}"

    def __str__(self) -> str:
        return f"{self.case}: {self.path}: {self.kind}: {self.detail}"


def _only_null(s: Any) -> bool:
    return isinstance(s, frozenset) and s == {NULL}


def _show(s: Any) -> str:
    if isinstance(s, frozenset):
        return "|".join(sorted(s))
    if isinstance(s, dict):
        return "object"
    return "list"


def diff_shapes(case: str, sim: Any, vllm: Any, path: str = "$") -> list[Difference]:
    out: list[Difference] = []
    if isinstance(sim, dict) and isinstance(vllm, dict):
        for key in sorted(set(sim) | set(vllm)):
            sub = f"{path}.{key}"
            if key not in sim:
                kind = "null-only" if _only_null(vllm[key]) else "missing in sim"
                out.append(Difference(case, sub, kind, f"vLLM: {_show(vllm[key])}"))
            elif key not in vllm:
                kind = "null-only" if _only_null(sim[key]) else "only in sim"
                out.append(Difference(case, sub, kind, f"sim: {_show(sim[key])}"))
            else:
                out += diff_shapes(case, sim[key], vllm[key], sub)
        return out
    if isinstance(sim, list) and isinstance(vllm, list):
        if sim and vllm:
            out += diff_shapes(case, sim[0], vllm[0], f"{path}[]")
        return out
    if isinstance(sim, frozenset) and isinstance(vllm, frozenset):
        # A random model's answer may not show every kind a field can take: compare the
        # kinds seen, and call it a difference only where they share none or one side is
        # null where the other never is.
        if sim != vllm and (not (sim & vllm) or (NULL in sim) != (NULL in vllm)):
            out.append(Difference(case, path, "type", f"sim {_show(sim)}, vLLM {_show(vllm)}"))
        return out
    out.append(Difference(case, path, "type", f"sim {_show(sim)}, vLLM {_show(vllm)}"))
    return out


def diff_values(case: str, sim: dict[str, Any], vllm: dict[str, Any]) -> list[Difference]:
    """Meaningful values (already extracted into flat dicts by the caller)."""
    out = []
    for key in sorted(set(sim) | set(vllm)):
        a, b = sim.get(key), vllm.get(key)
        if a != b:
            out.append(Difference(case, key, "value", f"sim {a!r}, vLLM {b!r}"))
    return out


def sse_events(raw: str) -> list[tuple[str | None, Any]]:
    """(event name or None, parsed data or the raw string) for each SSE event."""
    events = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].strip())
        text = "\n".join(data)
        try:
            events.append((name, json.loads(text)))
        except ValueError:
            events.append((name, text))
    return events


def classify(diffs: list[Difference], known: dict[str, str]) -> tuple[list, list, list]:
    """(null-only, known with their reason, unexpected) differences."""
    nulls, expected, unexpected = [], [], []
    for d in diffs:
        if d.kind == "null-only":
            nulls.append(d)
            continue
        reason = next((r for pat, r in known.items() if fnmatch.fnmatchcase(d.key(), pat)), None)
        if reason is None:
            unexpected.append(d)
        else:
            expected.append((d, reason))
    return nulls, expected, unexpected
