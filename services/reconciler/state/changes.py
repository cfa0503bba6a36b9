"""What one fold changed: a typed set of (kind, key) pairs.

`fold.apply()` returns the entities an event touched; the Postgres projection
writes just those rows and each controller looks only at the kinds it watches.
A `Change` is a NamedTuple, so it still compares equal to the plain
`("node", "a")` pair it replaced; code reads it through `ChangeSet` instead of
unpacking tuples by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal, NamedTuple

Kind = Literal[
    "node",
    "shard",
    "replica",
    "model",
    "tenant",
    "bands",
    "failure",
    "term",
    "scaled",
    "adapter",
    "holdings",
]

NODE: Kind = "node"
SHARD: Kind = "shard"
REPLICA: Kind = "replica"
MODEL: Kind = "model"
TENANT: Kind = "tenant"
BANDS: Kind = "bands"  # key "": the bands are one declaration
FAILURE: Kind = "failure"  # key: a replica id not placed yet
TERM: Kind = "term"  # key: the leader term, as text
# key: the (model, role) of a model's or pool's autoscaled count that changed or ended
SCALED: Kind = "scaled"
ADAPTER: Kind = "adapter"  # key: a LoRA adapter declared, changed or removed
HOLDINGS: Kind = "holdings"  # key: a base model whose adapter placement changed or ended

KINDS: frozenset[Kind] = frozenset(
    (NODE, SHARD, REPLICA, MODEL, TENANT, BANDS, FAILURE, TERM, SCALED, ADAPTER, HOLDINGS)
)


# A change's key: an entity's id or name, or a (model, role) for SCALED.
ChangeKey = str | tuple[str, str]


class Change(NamedTuple):
    kind: Kind
    key: ChangeKey


class ChangeSet:
    """Changes accumulated over one or more folded batches, grouped by kind."""

    __slots__ = ("_by_kind",)

    def __init__(self, changes: Iterable[tuple[str, ChangeKey]] = ()):
        self._by_kind: dict[str, set[ChangeKey]] = {}
        self.update(changes)

    def update(self, changes: Iterable[tuple[str, ChangeKey]]) -> None:
        for kind, key in changes:
            self._by_kind.setdefault(kind, set()).add(key)

    def keys(self, kind: Kind) -> set[ChangeKey]:
        """The keys of one kind (empty if none changed)."""
        return self._by_kind.get(kind, set())

    def touches(self, kinds: Iterable[Kind]) -> bool:
        return any(self._by_kind.get(k) for k in kinds)

    def only(self, kinds: Iterable[Kind]) -> ChangeSet:
        wanted = set(kinds)
        return ChangeSet(ch for ch in self if ch.kind in wanted)

    def __iter__(self) -> Iterator[Change]:
        for kind, keys in self._by_kind.items():
            for key in keys:
                yield Change(kind, key)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_kind.values())

    def __bool__(self) -> bool:
        return any(self._by_kind.values())

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, tuple) or len(item) != 2:
            return False
        return item[1] in self._by_kind.get(item[0], ())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChangeSet):
            return set(self) == set(other)
        if isinstance(other, (set, frozenset)):
            return set(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChangeSet({sorted(self)!r})"
