"""One band's queue in one pool: tenant round-robin, FIFO within a tenant.

A tenant with a thousand queued requests holds one place in the rotation, so
it takes one turn per round, not a thousand. Arrival order is kept separately
for the TTL: the oldest ticket always has the earliest deadline. Every
operation is O(1); OrderedDict gives constant-time removal from the middle,
which a client that disconnects while queued needs.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol


class Queued(Protocol):
    tenant_name: str
    deadline: float


class _TenantQueue:
    __slots__ = ("name", "items", "in_rotation")

    def __init__(self, name: str) -> None:
        self.name = name
        self.items: OrderedDict[Queued, None] = OrderedDict()
        self.in_rotation = False


class BandQueue:
    __slots__ = ("depth", "_rotation", "_tenants", "_arrivals")

    def __init__(self) -> None:
        self.depth = 0
        self._rotation: deque[_TenantQueue] = deque()
        self._tenants: dict[str, _TenantQueue] = {}
        self._arrivals: OrderedDict[Queued, None] = OrderedDict()

    def push(self, item: Queued) -> None:
        tq = self._tenants.get(item.tenant_name)
        if tq is None:
            tq = self._tenants[item.tenant_name] = _TenantQueue(item.tenant_name)
        tq.items[item] = None
        if not tq.in_rotation:
            tq.in_rotation = True
            self._rotation.append(tq)
        self._arrivals[item] = None
        self.depth += 1

    def pop(self) -> Queued | None:
        """The next item: the head of the next tenant in the rotation."""
        while self._rotation:
            tq = self._rotation.popleft()
            if not tq.items:  # emptied by removals since it last had a turn
                self._retire(tq)
                continue
            item, _ = tq.items.popitem(last=False)
            if tq.items:
                self._rotation.append(tq)
            else:
                self._retire(tq)
            del self._arrivals[item]
            self.depth -= 1
            return item
        return None

    def _retire(self, tq: _TenantQueue) -> None:
        tq.in_rotation = False
        if self._tenants.get(tq.name) is tq:
            del self._tenants[tq.name]

    def remove(self, item: Queued) -> bool:
        """Take out an item that is still queued (cancelled); False if it is not here."""
        if item not in self._arrivals:
            return False
        del self._arrivals[item]
        del self._tenants[item.tenant_name].items[item]
        self.depth -= 1
        return True

    def oldest(self) -> Queued | None:
        """The item queued longest (arrival order, whatever the tenant rotation)."""
        for item in self._arrivals:
            return item
        return None

    def next_deadline(self) -> float | None:
        for item in self._arrivals:
            return item.deadline
        return None

    def expire(self, now: float) -> list[Queued]:
        """Remove and return every item whose deadline has passed, oldest first."""
        out: list[Queued] = []
        while self._arrivals:
            item = next(iter(self._arrivals))
            if item.deadline > now:
                break
            self.remove(item)
            out.append(item)
        return out
