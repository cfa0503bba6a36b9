"""Every NATS subject, stream and bucket name, built in one place.

Nothing else formats a subject by hand: per-publisher prefixes are what make
NATS permissions simple (an agent publishes only under its own node, consumes
only its own commands), and one module keeps that true.
"""

from __future__ import annotations

import re

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


def demand(router_id: str) -> str:
    return f"{ROOT}.demand.{safe_token(router_id)}"


def node_of_subject(subject: str) -> str | None:
    """The node id a per-node subject belongs to, or None."""
    parts = subject.split(".")
    if len(parts) >= 3 and parts[0] == ROOT:
        if parts[1] in ("hb", "cmd", "load"):
            return parts[2]
        if parts[1] == "evt" and len(parts) >= 4 and parts[2] == "agent":
            return parts[3]
    return None


def subject_for(msg: c.Message) -> str:
    """The subject a message is published on."""
    match msg:
        case c.NodeRegistered():
            return agent_event(msg.node, "registered")
        case c.ShardStatus():
            return agent_event(msg.node, "shard")
        case c.Heartbeat():
            return heartbeat(msg.node)
        case c.ModelDeclared() | c.ModelRemoved():
            return catalog_event("model", msg.name)
        case c.TenantDeclared() | c.TenantRemoved():
            return catalog_event("tenant", msg.name)
        case c.BandsDeclared():
            return catalog_event("bands", "all")
        case c.PlacementDecided() | c.PlacementFailed() | c.ReplicaRetired():
            return control_event("placement", msg.replica_id)
        case c.ModelScaled():
            return control_event("scale", msg.model)
        case c.NodeUnreachable() | c.NodeLost() | c.NodeRecovered():
            return control_event("node", msg.node)
        case c.StartShard() | c.StopShard() | c.DrainShard():
            return commands(msg.node)
        case c.LoadSample():
            return load(msg.node)
        case c.DemandSummary():
            return demand(msg.router_id)
    raise SubjectError(f"{type(msg).__name__} is not published on a subject")


# KV keys. KV keys allow dots, but one token per model keeps watches simple.
def endpoints_key(model: str) -> str:
    return safe_token(model)


def tenant_key(name: str) -> str:
    return f"tenant.{safe_token(name)}"


BANDS_KEY = "bands"


def router_key(router_id: str) -> str:
    return safe_token(router_id)


# Channel descriptions for the AsyncAPI document: (address, stream or None, messages).
CHANNELS: list[tuple[str, str, str | None, tuple[type[c.Message], ...]]] = [
    (
        "agentEvents",
        f"{ROOT}.evt.agent.{{node}}.{{kind}}",
        EVENTS_STREAM,
        (c.NodeRegistered, c.ShardStatus),
    ),
    (
        "catalogEvents",
        f"{ROOT}.evt.catalog.{{kind}}.{{name}}",
        EVENTS_STREAM,
        (c.ModelDeclared, c.ModelRemoved, c.TenantDeclared, c.TenantRemoved, c.BandsDeclared),
    ),
    (
        "controlEvents",
        f"{ROOT}.evt.control.{{kind}}.{{id}}",
        EVENTS_STREAM,
        (
            c.PlacementDecided,
            c.PlacementFailed,
            c.ReplicaRetired,
            c.ModelScaled,
            c.NodeUnreachable,
            c.NodeLost,
            c.NodeRecovered,
        ),
    ),
    ("heartbeats", f"{ROOT}.hb.{{node}}", HEARTBEATS_STREAM, (c.Heartbeat,)),
    (
        "commands",
        f"{ROOT}.cmd.{{node}}",
        COMMANDS_STREAM,
        (c.StartShard, c.StopShard, c.DrainShard),
    ),
    ("loadSamples", f"{ROOT}.load.{{node}}", None, (c.LoadSample,)),
    ("demandSummaries", f"{ROOT}.demand.{{router}}", None, (c.DemandSummary,)),
    (
        "endpointProjection",
        f"$KV.{ENDPOINTS_BUCKET}.{{model}}",
        f"KV_{ENDPOINTS_BUCKET}",
        (c.ModelEndpoints,),
    ),
    (
        "tenantProjection",
        f"$KV.{TENANTS_BUCKET}.{{key}}",
        f"KV_{TENANTS_BUCKET}",
        (c.TenantRecord, c.BandsRecord),
    ),
    (
        "routerPresence",
        f"$KV.{ROUTERS_BUCKET}.{{router}}",
        f"KV_{ROUTERS_BUCKET}",
        (c.RouterPresence,),
    ),
]
