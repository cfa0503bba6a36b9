"""Placement verdict groups in words: shared by the reconciler (replay diffs) and
`llmgw explain`, which must not import the reconciler."""

from __future__ import annotations

from llmgw import contracts as c


def group_line(g: c.VerdictGroup) -> str:
    """One group in words, e.g. "35 nodes: label zone=z2 does not match zone=z1: node-0007, ..."."""
    names = ", ".join(g.nodes) + (", ..." if g.count > len(g.nodes) else "")
    nodes = "1 node" if g.count == 1 else f"{g.count} nodes"
    if g.same:
        return f"{nodes}: {g.reason}: {names}"
    return f"{nodes}: {g.kind}: {names} (e.g. {g.nodes[0]}: {g.reason})"
