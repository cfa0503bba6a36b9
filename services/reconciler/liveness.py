"""Node liveness from heartbeats: silence becomes unreachable, then lost; voice recovers.

`LivenessTracker` is pure over its inputs: `seen(node, at)` records a sign of
life (a heartbeat, a registration) at a time the caller supplies, and
`check(state, now)` returns the transitions the silence calls for as events
(NodeUnreachable, NodeLost, NodeRecovered). The transitions go into the log,
so the folded liveness — the one placement reads — never depends on a clock,
and replay reproduces it exactly.

A new leader does not know when it last heard from each node: it rebuilds
last-seen from the newest heartbeat per node kept in LLMGW_HEARTBEATS, and
counts silence from no earlier than its own start (`started_at`), so a
leadership change alone never makes a node unreachable. Likewise, while the
leader's own NATS connection is down it hears no heartbeats at all: silence
then says nothing about the nodes, so it is not judged until the connection is
back and is counted from that moment (`listening`). Recovery needs a
heartbeat newer than `unreachable_after`, which the rebuilt one of a dead node
is not.

A transition is published once: the tracker remembers what it sent until the
folded state shows it (or `pending_timeout` passes, in case the publish was
lost), so ticks between publish and fold do not repeat it.
"""

from __future__ import annotations

from llmgw import contracts as c

from .placement import event_id
from .state import ClusterState, Liveness


class LivenessTracker:
    def __init__(
        self,
        unreachable_after: float,
        lost_after: float,
        started_at: float,
        pending_timeout: float = 30.0,
    ):
        if lost_after < unreachable_after:
            raise ValueError("lost_after must not be shorter than unreachable_after")
        self.unreachable_after = unreachable_after
        self.lost_after = lost_after
        self.started_at = started_at
        self.pending_timeout = pending_timeout
        self.last_seen: dict[str, float] = {}
        self._pending: dict[str, tuple[Liveness, float]] = {}
        self.deaf = False  # our bus connection is down: we hear no node

    def listening(self, connected: bool, now: float) -> bool:
        """Whether silence may be judged now, given our connection to the bus.

        A bus outage silences every node at once; without this a leader cut off
        for longer than `lost_after` would declare the whole fleet lost and move
        every replica the moment it reconnected."""
        if not connected:
            self.deaf = True
            return False
        if self.deaf:
            self.deaf = False
            self.grace(now)
        return True

    def grace(self, now: float) -> None:
        """Count silence from `now`: we were not listening (a new term, a stalled loop)."""
        self.started_at = max(self.started_at, now)

    def seen(self, node: str, at: float) -> None:
        if at > self.last_seen.get(node, float("-inf")):
            self.last_seen[node] = at

    def silence(self, node: str, now: float) -> float:
        return now - max(self.last_seen.get(node, float("-inf")), self.started_at)

    def _target(self, node: str, current: Liveness, now: float) -> Liveness:
        last = self.last_seen.get(node)
        if last is not None and now - last < self.unreachable_after:
            return Liveness.ALIVE
        quiet = self.silence(node, now)
        if quiet >= self.lost_after:
            return Liveness.LOST
        if quiet >= self.unreachable_after:
            return Liveness.UNREACHABLE
        return current  # inside the grace period after leadership began: no news

    def check(self, state: ClusterState, now: float) -> list[c.Message]:
        out: list[c.Message] = []
        for name in sorted(state.nodes):
            view = state.nodes[name]
            pending = self._pending.get(name)
            if pending is not None:
                if view.liveness != pending[0] and now - pending[1] < self.pending_timeout:
                    continue  # published, not folded yet
                del self._pending[name]
            current = view.liveness
            target = self._target(name, current, now)
            if target == current or (current == Liveness.LOST and target != Liveness.ALIVE):
                continue  # lost stays lost until the node speaks again
            last = self.last_seen.get(name, view.registered_at)
            seq = state.last_seq
            if target == Liveness.ALIVE:
                out.append(
                    c.NodeRecovered(
                        id=event_id("recovered", name, last), ts=now, node=name, based_on_seq=seq
                    )
                )
            else:
                if current == Liveness.ALIVE:
                    out.append(
                        c.NodeUnreachable(
                            id=event_id("unreachable", name, last),
                            ts=now,
                            node=name,
                            last_seen=last,
                            based_on_seq=seq,
                        )
                    )
                if target == Liveness.LOST:
                    out.append(
                        c.NodeLost(
                            id=event_id("lost", name, last),
                            ts=now,
                            node=name,
                            last_seen=last,
                            based_on_seq=seq,
                        )
                    )
            self._pending[name] = (target, now)
        return out
