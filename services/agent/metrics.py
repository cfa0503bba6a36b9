"""Engine load from a Prometheus /metrics page, as the agent's load samples carry it.

`llmgw.enginemetrics` parses the page (the router's fallback scraping reads engines
through the same parser); its `EngineLoad` is the agent's `Load`.
"""

from __future__ import annotations

from llmgw.enginemetrics import EngineLoad as Load
from llmgw.enginemetrics import parse

__all__ = ["Load", "parse_load"]


def parse_load(text: str) -> Load | None:
    """The load an engine reports, or None when the page has none of the known gauges."""
    return parse(text.encode())
