"""Rendering for operator commands: aligned tables with a header row, or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [
        ["-" if v in (None, "") else str(v) for v in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in cells
    ]
    return "\n".join(lines)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False)


def csv(values: Sequence[Any]) -> str:
    return ",".join(str(v) for v in values)


def gib(n: int | float) -> str:
    return f"{n / (1 << 30):.0f}GiB"
