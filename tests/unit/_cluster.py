"""Builders for cluster states in tests: events folded in order, like the real log."""

from __future__ import annotations

import zlib

from llmgw import contracts as c
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.model import ClusterState

GIB = 1 << 30


def gpus(n: int, mem_gib: int = 80, node: str = "n") -> dict[str, c.GpuInfo]:
    return {
        f"{node}-GPU-{i}": c.GpuInfo(
            uuid=f"{node}-GPU-{i}", index=i, name="H100", memory_bytes=mem_gib * GIB
        )
        for i in range(n)
    }


def node(
    name: str,
    n_gpus: int = 2,
    *,
    mem_gib: int = 80,
    labels: dict[str, str] | None = None,
    engines: tuple[str, ...] = ("sim", "vllm"),
    shards: list[c.ShardInfo] | None = None,
    ts: float = 1000.0,
) -> c.NodeRegistered:
    return c.NodeRegistered(
        node=name,
        ts=ts,
        gpus=gpus(n_gpus, mem_gib, name),
        labels=labels or {},
        engines=list(engines),
        host=c.HostInfo(address=f"10.0.0.{zlib.crc32(name.encode()) % 250}"),
        shards=shards or [],
    )


def model(name: str = "m", replicas: int = 1, **profile) -> c.ModelDeclared:
    return c.ModelDeclared(name=name, replicas=replicas, profile=c.ServingProfile(**profile))


def status(state: ClusterState, shard_id: str, st: c.ShardState, **kw) -> c.ShardStatus:
    sh = state.shards[shard_id]
    return c.ShardStatus(
        node=sh.node,
        shard_id=shard_id,
        model=sh.model,
        replica_id=sh.replica_id,
        shard_index=sh.shard_index,
        state=st,
        url=kw.pop("url", f"http://{sh.node}:{8000 + sh.shard_index}"),
        **kw,
    )


class Log:
    """An in-memory event log folded into a state as events are appended."""

    def __init__(self) -> None:
        self.state = ClusterState()
        self.events: list[tuple[int, c.Message]] = []

    def append(self, *events: c.Message) -> Log:
        for ev in events:
            self.apply(ev)
        return self

    def apply(self, ev: c.Message) -> set:
        """Append one event; return what the fold says it changed."""
        # Round-trip through the wire format: what replay reads is what was sent.
        ev = c.decode(c.encode(ev))
        seq = len(self.events) + 1
        self.events.append((seq, ev))
        return fold.apply(self.state, seq, ev)
