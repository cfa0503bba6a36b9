"""Node liveness from heartbeats: silence becomes unreachable, then lost; voice recovers.

`LivenessTracker` is pure over its inputs: `seen(node, at, wall)` records a
sign of life (a heartbeat, a registration) received now, and `check(state,
now, wall)` returns the transitions the silence calls for as events
(NodeUnreachable, NodeLost, NodeRecovered). The transitions go into the log,
so the folded liveness — the one placement reads — never depends on a clock,
and replay reproduces it exactly.

Silence is measured on a monotonic clock (`at`, `now`): the wall clock can
step (NTP, a VM resumed, an operator's `date -s`), and a step forward larger
than `lost_after` would otherwise declare the whole fleet lost at once, a step
back keep a dead node alive for as long as the step. Wall times (`wall`) only
stamp the events and say in them when a node was last heard.

A new leader does not know how long each node has been silent: it counts
silence from its own start (`started_at`, monotonic), so a leadership change
alone never makes a node unreachable. The newest heartbeat per node kept in
LLMGW_HEARTBEATS (`remember`) carries the time another clock (the NATS
server's) stored it: it is reported as the node's last sign of life but proves
nothing, neither life (a clock ahead would "recover" a dead node) nor death;
recovery needs a heartbeat received live. Likewise, while the leader's own
NATS connection is down it hears no heartbeats at all: silence then says
nothing about the nodes, so it is not judged until the connection is back and
is counted from that moment (`listening`).

A transition is published once: the tracker remembers what it sent until the
folded state shows it (or `pending_timeout` passes, in case the publish was
lost), so ticks between publish and fold do not repeat it.
"""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.reconciler.state.ids import event_id
from llmgw.reconciler.state.model import ClusterState, Liveness


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
        self.last_seen: dict[str, float] = {}  # monotonic: heartbeats received live
        self.last_wall: dict[str, float] = {}  # wall: for reports only, never judged
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

    def seen(self, node: str, at: float, wall: float | None = None) -> None:
        """A sign of life received now: `at` on the monotonic clock, `wall` (default `at`:
        one clock for both) for reports."""
        if at > self.last_seen.get(node, float("-inf")):
            self.last_seen[node] = at
        self.remember(node, at if wall is None else wall)

    def remember(self, node: str, wall: float) -> None:
        """When the node was last heard by some wall clock (a stored heartbeat's): reported
        in the events, never taken as proof of life or death."""
        if wall > self.last_wall.get(node, float("-inf")):
            self.last_wall[node] = wall

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

    def check(self, state: ClusterState, now: float, wall: float | None = None) -> list[c.Message]:
        """Transitions due at monotonic `now`; events stamped with `wall` (default `now`)."""
        ts = now if wall is None else wall
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
            last = self.last_wall.get(name, view.registered_at)
            seq = state.last_seq
            if target == Liveness.ALIVE:
                out.append(
                    c.NodeRecovered(
                        id=event_id("recovered", name, last), ts=ts, node=name, based_on_seq=seq
                    )
                )
            else:
                if current == Liveness.ALIVE:
                    out.append(
                        c.NodeUnreachable(
                            id=event_id("unreachable", name, last),
                            ts=ts,
                            node=name,
                            last_seen=last,
                            based_on_seq=seq,
                        )
                    )
                if target == Liveness.LOST:
                    out.append(
                        c.NodeLost(
                            id=event_id("lost", name, last),
                            ts=ts,
                            node=name,
                            last_seen=last,
                            based_on_seq=seq,
                        )
                    )
            self._pending[name] = (target, now)
        return out
