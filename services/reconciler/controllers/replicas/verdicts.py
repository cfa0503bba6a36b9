"""Which node verdicts a placement event lists one by one, and how it counts the rest.

A decision explains itself per node, but an event cannot grow with the fleet:
NATS refuses payloads over 1 MiB, which a verdict per node reaches near 12,000
nodes. So up to `KEEP_ALL_UP_TO` nodes every verdict is listed (small fleets
read exactly as before); beyond it only the chosen nodes and the best-ranked
fitting ones are, and every other node is counted in a group of its reason's
*kind* (what all the group's reasons have in common: "no free GPU", "label zone
does not match zone=z1"), with its first few node ids and the first one's
verdict word for word. A kind whose nodes give only a few distinct reasons
("label zone=z0 ...", "label zone=z2 ...") gets a group per reason, exact for
every node in it; one whose reasons embed per-node numbers or times stays one
group. The kinds come from placement's node filters (placement.NODE_FILTERS,
GROUP_FILTERS), each of which names its own, bounded by the profile, not by
the fleet; so is the number of groups (kinds x `SPLIT_UP_TO`).

Pure and deterministic like placement itself: nodes arrive in node-id order and
groups are sorted, so `llmgw audit replay` re-derives the same summary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from llmgw import contracts as c

if TYPE_CHECKING:
    from llmgw.reconciler.controllers.replicas.placement import Fit

KEEP_ALL_UP_TO = 200  # nodes: at most this many, every verdict is listed
KEEP_BEST = 5  # beyond it: the chosen nodes, plus this many best-ranked fitting ones
EXAMPLES = 5  # node ids named per group
SPLIT_UP_TO = 4  # distinct reasons of one kind that still get a group each


def summarise(
    fits: Sequence[Fit], listed: Collection[str], *, keep_all: bool = False
) -> tuple[list[c.NodeVerdict], list[c.VerdictGroup]]:
    """(verdicts of the `listed` nodes, groups of all others); every verdict when few nodes.

    `fits` must be in node-id order: group examples are the first ids of each group.
    """
    if keep_all or len(fits) <= KEEP_ALL_UP_TO:
        return [c.NodeVerdict(node=f.node, fits=f.fits, reason=f.reason) for f in fits], []
    verdicts: list[c.NodeVerdict] = []
    members: dict[tuple[bool, str], list[Fit]] = {}
    for f in fits:
        if f.node in listed:
            verdicts.append(c.NodeVerdict(node=f.node, fits=f.fits, reason=f.reason))
        else:
            members.setdefault((f.fits, f.kind), []).append(f)
    groups = []
    for (fit, kind), group in members.items():
        by_reason: dict[str, list[Fit]] = {}
        for f in group:
            by_reason.setdefault(f.reason, []).append(f)
        parts = list(by_reason.values()) if len(by_reason) <= SPLIT_UP_TO else [group]
        groups += [_group(fit, kind, part, same=len(parts) > 1 or len(by_reason) == 1)
                   for part in parts]  # fmt: skip
    # Fitting nodes first, then the most common reasons: the ones an operator acts on.
    groups.sort(key=lambda g: (not g.fits, -g.count, g.kind, g.nodes[0]))
    return verdicts, groups


def _group(fit: bool, kind: str, members: list[Fit], *, same: bool) -> c.VerdictGroup:
    return c.VerdictGroup(
        fits=fit,
        kind=kind,
        count=len(members),
        nodes=[f.node for f in members[:EXAMPLES]],
        reason=members[0].reason,
        same=same,
        digest=member_digest(f.node for f in members),
    )


def member_digest(nodes: Iterable[str]) -> str:
    """A short fingerprint of a group's members, in node-id order."""
    return hashlib.sha256("\x1f".join(nodes).encode()).hexdigest()[:16]


def node_count(d: c.PlacementDecided | c.PlacementFailed) -> tuple[int, int]:
    """(nodes that fit, nodes considered), listed and grouped together."""
    fit = sum(v.fits for v in d.verdicts) + sum(g.count for g in d.verdict_groups if g.fits)
    return fit, len(d.verdicts) + sum(g.count for g in d.verdict_groups)
