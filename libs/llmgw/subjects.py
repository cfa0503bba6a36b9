"""Every NATS subject, stream and bucket name, built in one place.

Nothing else formats a subject by hand: per-publisher prefixes are what make
NATS permissions simple (an agent publishes only under its own node, consumes
only its own commands), and one module keeps that true.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

from llmgw import contracts as c

# Streams and buckets.
EVENTS_STREAM = "LLMGW_EVENTS"
HEARTBEATS_STREAM = "LLMGW_HEARTBEATS"
COMMANDS_STREAM = "LLMGW_COMMANDS"
ENDPOINTS_BUCKET = "llmgw-endpoints"
TENANTS_BUCKET = "llmgw-tenants"
ROUTERS_BUCKET = "llmgw-routers"

ROOT = "llmgw"
EVENTS_ALL = f"{ROOT}.evt.>"
HEARTBEATS_ALL = f"{ROOT}.hb.*"
COMMANDS_ALL = f"{ROOT}.cmd.*"
LOAD_ALL = f"{ROOT}.load.*"
KV_EVENTS_ALL = f"{ROOT}.kv.>"


DEMAND_ALL = f"{ROOT}.demand.*"

# A token is one dot-free, wildcard-free piece of a subject.
_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


class SubjectError(ValueError):
    pass


def token(value: str, what: str = "name") -> str:
    """Check that `value` can be one subject token (node ids, model names...)."""
    if not _TOKEN.match(value or ""):
        raise SubjectError(
            f"{what} {value!r} cannot be used in a NATS subject: "
            "use letters, digits, '-' and '_' only"
        )
    return value


def safe_token(value: str) -> str:
    """Map any string (a model name such as 'org/model:v1') onto one subject token."""
    out = re.sub(r"[^A-Za-z0-9_\-]", "_", value)
    return out or "_"


# Agent events: llmgw.evt.agent.<node>.<type>
def agent_event(node: str, kind: str) -> str:
    return f"{ROOT}.evt.agent.{token(node, 'node id')}.{kind}"


def agent_events_of(node: str) -> str:
    return f"{ROOT}.evt.agent.{token(node, 'node id')}.>"


def catalog_event(kind: str, name: str) -> str:
    return f"{ROOT}.evt.catalog.{kind}.{safe_token(name)}"


def control_event(kind: str, ident: str) -> str:
    return f"{ROOT}.evt.control.{kind}.{safe_token(ident)}"


def heartbeat(node: str) -> str:
    return f"{ROOT}.hb.{token(node, 'node id')}"


def commands(node: str) -> str:
    return f"{ROOT}.cmd.{token(node, 'node id')}"


def load(node: str) -> str:
    return f"{ROOT}.load.{token(node, 'node id')}"


# KV cache events and snapshots: llmgw.kv.<node>.<shard>, llmgw.kvsnap.<node>.<shard>
def kv_events(node: str, shard_id: str) -> str:
    return f"{ROOT}.kv.{token(node, 'node id')}.{safe_token(shard_id)}"


def kv_snapshot(node: str, shard_id: str) -> str:
    return f"{ROOT}.kvsnap.{token(node, 'node id')}.{safe_token(shard_id)}"


def kv_snapshots_of(node: str) -> str:
    return f"{ROOT}.kvsnap.{token(node, 'node id')}.*"


def demand(router_id: str) -> str:
    return f"{ROOT}.demand.{safe_token(router_id)}"


def node_of_subject(subject: str) -> str | None:
    """The node id a per-node subject belongs to, or None."""
    parts = subject.split(".")
    if len(parts) >= 3 and parts[0] == ROOT:
        if parts[1] in ("hb", "cmd", "load", "kv", "kvsnap"):
            return parts[2]
        if parts[1] == "evt" and len(parts) >= 4 and parts[2] == "agent":
            return parts[3]
    return None


def _control_event(msg: c.Message) -> str:
    kind = msg.subject_kind
    # Node events per node, scaling and adapter decisions per model, terms by number, placement per replica.
    if kind == "term":
        return control_event(kind, str(msg.term))  # type: ignore[attr-defined]
    field = {"node": "node", "scale": "model", "adapters": "model"}.get(kind, "replica_id")
    return control_event(kind, getattr(msg, field))


def _kv_snapshot_request(msg: c.Message) -> str:
    if not isinstance(msg, c.KvSnapshotRequest):  # a snapshot is a reply, sent to an inbox
        raise SubjectError(f"{type(msg).__name__} is not published on a subject")
    return kv_snapshot(msg.node, msg.shard_id)


class Route(NamedTuple):
    """Where a channel's messages go: its AsyncAPI address, the stream (or KV bucket's
    stream) that keeps them, and how one message's subject is made (None: a KV record,
    stored under a key rather than published on a subject)."""

    address: str
    stream: str | None
    subject: Callable[[c.Message], str] | None


# One route per channel of contracts.CHANNELS (a test checks they match).
ROUTES: dict[str, Route] = {
    "agentEvents": Route(
        f"{ROOT}.evt.agent.{{node}}.{{kind}}",
        EVENTS_STREAM,
        lambda m: agent_event(m.node, m.subject_kind),  # type: ignore[attr-defined]
    ),
    "catalogEvents": Route(
        f"{ROOT}.evt.catalog.{{kind}}.{{name}}",
        EVENTS_STREAM,
        # The bands are one declaration for the whole catalog.
        lambda m: catalog_event(m.subject_kind, getattr(m, "name", "all")),
    ),
    "controlEvents": Route(f"{ROOT}.evt.control.{{kind}}.{{id}}", EVENTS_STREAM, _control_event),
    "heartbeats": Route(
        f"{ROOT}.hb.{{node}}",
        HEARTBEATS_STREAM,
        lambda m: heartbeat(m.node),  # type: ignore[attr-defined]
    ),
    "commands": Route(
        f"{ROOT}.cmd.{{node}}",
        COMMANDS_STREAM,
        lambda m: commands(m.node),  # type: ignore[attr-defined]
    ),
    "loadSamples": Route(
        f"{ROOT}.load.{{node}}",
        None,
        lambda m: load(m.node),  # type: ignore[attr-defined]
    ),
    "kvEvents": Route(
        f"{ROOT}.kv.{{node}}.{{shard}}",
        None,
        lambda m: kv_events(m.node, m.shard_id),  # type: ignore[attr-defined]
    ),
    "kvSnapshots": Route(f"{ROOT}.kvsnap.{{node}}.{{shard}}", None, _kv_snapshot_request),
    "endpointProjection": Route(
        f"$KV.{ENDPOINTS_BUCKET}.{{model}}", f"KV_{ENDPOINTS_BUCKET}", None
    ),
    "tenantProjection": Route(f"$KV.{TENANTS_BUCKET}.{{key}}", f"KV_{TENANTS_BUCKET}", None),
    "routerPresence": Route(f"$KV.{ROUTERS_BUCKET}.{{router}}", f"KV_{ROUTERS_BUCKET}", None),
    "demandSummaries": Route(
        f"{ROOT}.demand.{{router}}",
        None,
        lambda m: demand(m.router_id),  # type: ignore[attr-defined]
    ),
}


def subject_for(msg: c.Message) -> str:
    """The subject a message is published on."""
    route = ROUTES.get(c.CHANNEL_OF.get(type(msg), ""))
    if route is None or route.subject is None:
        raise SubjectError(f"{type(msg).__name__} is not published on a subject")
    return route.subject(msg)


# KV keys of the router projection: llmgw.projection. A router's presence key:
def router_key(router_id: str) -> str:
    return safe_token(router_id)


def router_presence(router_id: str) -> str:
    """The subject a router's presence key is put, deleted and purged on."""
    return f"$KV.{ROUTERS_BUCKET}.{router_key(router_id)}"


# Channel descriptions for the AsyncAPI document: (name, address, stream or None, messages).
CHANNELS: list[tuple[str, str, str | None, tuple[type[c.Message], ...]]] = [
    (name, route.address, route.stream, c.CHANNELS[name]) for name, route in ROUTES.items()
]
