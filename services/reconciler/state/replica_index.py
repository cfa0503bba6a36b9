"""The highest replica number per id token and per model, so the next id costs O(1).

`queries.next_replica_id` gives a model one above every number among the ids
of its token or of its replicas. Replicas are never removed from the state
(retired ones stay, flagged), so scanning them all grows with the fleet's whole
history: 100k replicas after months of scaling up and down. This index holds
the two maxima instead.

It is derived, never stored: not a field of `ClusterState` but an attribute
beside it, so the state's equality, its encoding, the projection tables and
`audit verify` never see it, and Postgres holds nothing new. It catches up by
itself instead of being fed by every place replicas enter the state (the fold,
a load from the tables, a replay, a test building a state by hand): a dict
keeps insertion order and replicas are only added, so the entries it has not
read yet are the last ones, read from the end. It starts over when the state
holds another replicas dict or fewer replicas than it has read. The one change
it cannot see is an id placed a second time (the fold's checks refuse it):
the fold calls `forget` then.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

from llmgw.reconciler.state.ids import parse_replica_id

_ATTR = "_replica_index"


class _Replica(Protocol):
    model: str
    role: str


class ReplicaIndex:
    __slots__ = ("replicas", "read", "by_token", "by_model")

    def __init__(self, replicas: dict[str, Any]):
        self.replicas = replicas
        self.read = 0  # how many of the dict's entries, from the start, are counted
        self.by_token: dict[str, int] = {}
        # Per (model, role): a disaggregated model's pools are numbered apart.
        self.by_model: dict[tuple[str, str], int] = {}

    def top(self, token: str, model: str, role: str = "") -> int:
        """The highest number among ids with `token` or of replicas of `model` in the pool
        `role`; 0 if none."""
        return max(self.by_token.get(token, 0), self.by_model.get((model, role), 0))

    def catch_up(self) -> None:
        new = len(self.replicas) - self.read
        if new <= 0:
            return
        for rid, replica in itertools.islice(reversed(self.replicas.items()), new):
            self._count(rid, replica)
        self.read = len(self.replicas)

    def _count(self, rid: str, replica: _Replica) -> None:
        parsed = parse_replica_id(rid)
        if parsed is None:
            return
        token, n = parsed
        if n > self.by_token.get(token, 0):
            self.by_token[token] = n
        pool = (replica.model, replica.role)
        if n > self.by_model.get(pool, 0):
            self.by_model[pool] = n

    def for_copy(self, replicas: dict[str, Any]) -> ReplicaIndex:
        """This index for a copy of its dict (same keys, same order, same models)."""
        out = ReplicaIndex(replicas)
        out.read = self.read
        out.by_token = dict(self.by_token)
        out.by_model = dict(self.by_model)
        return out


def index_of(state: Any) -> ReplicaIndex:
    """The state's index, up to date with `state.replicas`."""
    index: ReplicaIndex | None = getattr(state, _ATTR, None)
    if index is None or index.replicas is not state.replicas or index.read > len(index.replicas):
        index = ReplicaIndex(state.replicas)
        setattr(state, _ATTR, index)
    index.catch_up()
    return index


def carry(source: Any, copy: Any) -> None:
    """Give `copy`, whose replicas copy `source`'s in order, the index `source` has."""
    index: ReplicaIndex | None = getattr(source, _ATTR, None)
    if index is not None and index.replicas is source.replicas:
        setattr(copy, _ATTR, index.for_copy(copy.replicas))


def forget(state: Any) -> None:
    """Drop the state's index: an entry of its replicas was replaced, not added."""
    if getattr(state, _ATTR, None) is not None:
        setattr(state, _ATTR, None)
