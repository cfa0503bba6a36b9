"""`llmgw nats-config`: a nats-server config for mutual TLS with per-identity permissions.

The server verifies every client certificate against the CA and maps its
subject (`CN=agent-n1,O=llmgw`, see llmgw.certs) to a user whose permissions
are allow-lists built here from llmgw.subjects, so the rules follow the
subject layout instead of being typed twice:

- an agent publishes only its own node's events, heartbeat and load samples,
  and reaches exactly one consumer on LLMGW_COMMANDS: its own durable
  `agent-<node>`, filtered on its own command subject;
- a router reads the projection buckets and subscribes to load samples; it
  writes only its own presence key and publishes only its own demand subject,
  both named by its router id (`Identity.router_id`), so it cannot change the
  live-router count or the autoscaler's input for another router;
- the reconciler gets the event log, commands and all buckets;
- the operator CLI publishes catalog events and reads the log and buckets.

Every identity subscribes only under its own inbox prefix (`_INBOX.<name>`),
so no identity can read the replies (JetStream acks, API answers, pulled
messages) meant for another. Clients must therefore connect with that
prefix; `llmgw.tlsconfig.nats_options()` derives it from the certificate.

Pure functions (`permissions`, `render`) build the config; `run` does the I/O.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from llmgw import subjects as s
from llmgw.certs import (
    CA_NAME,
    SERVER_NAME,
    CertError,
    Identity,
    identity_from_name,
    read_identities,
)

API = "$JS.API"
INBOX_ROOT = "_INBOX"


def inbox_prefix(identity_name: str) -> str:
    """The reply-subject prefix a client with this identity must use."""
    return f"{INBOX_ROOT}.{identity_name}"


def _kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def _stream_reader(stream: str) -> list[str]:
    """Publish rules to read a stream through ephemeral/ordered consumers and gets.

    Consumer creation is allowed with and without the trailing name/filter
    tokens: nats-py uses the bare form for unnamed (ordered) consumers and
    the long form for named ones.
    """
    return [
        f"{API}.STREAM.INFO.{stream}",
        f"{API}.STREAM.MSG.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}.>",
        f"{API}.CONSUMER.CREATE.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}.>",
        f"{API}.CONSUMER.INFO.{stream}.>",
        f"{API}.CONSUMER.DELETE.{stream}.>",
        f"{API}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _kv_reader(bucket: str) -> list[str]:
    return _stream_reader(_kv_stream(bucket))


# Harmless metadata every client library asks for (account info, stream lookup).
_COMMON_PUBLISH = [f"{API}.INFO", f"{API}.STREAM.NAMES"]


def agent_durable(node: str) -> str:
    return f"agent-{s.token(node, 'node id')}"


def permissions(ident: Identity) -> dict[str, Any]:
    """The publish/subscribe allow-lists of one identity."""
    inbox = f"{inbox_prefix(ident.name)}.>"
    if ident.role == "agent":
        node = ident.node or ""
        durable = agent_durable(node)
        cmd = s.COMMANDS_STREAM
        publish = [
            s.agent_events_of(node),
            s.heartbeat(node),
            s.load(node),
            f"{s.ROOT}.kv.{s.token(node, 'node id')}.*",
            *_COMMON_PUBLISH,
            *(f"{API}.STREAM.INFO.{st}" for st in _agent_streams()),
            # Only its own durable, and only the create form that names the filter:
            # the server rejects a body whose filter differs from the subject's, so
            # agent-a cannot point its consumer at node b's commands. The legacy
            # DURABLE.CREATE form carries no filter in the subject and stays denied.
            f"{API}.CONSUMER.CREATE.{cmd}.{durable}.{s.commands(node)}",
            f"{API}.CONSUMER.INFO.{cmd}.{durable}",
            f"{API}.CONSUMER.MSG.NEXT.{cmd}.{durable}",
            f"$JS.ACK.{cmd}.{durable}.>",
        ]
        # Snapshot requests for its own engines, answered on the asker's inbox.
        subscribe = [inbox, s.kv_snapshots_of(node)]
        return {
            "publish": {"allow": publish},
            "subscribe": {"allow": subscribe},
            "allow_responses": True,
        }
    if ident.role == "router":
        router_id = ident.router_id or ""
        publish = [
            *_COMMON_PUBLISH,
            *_kv_reader(s.ENDPOINTS_BUCKET),
            *_kv_reader(s.TENANTS_BUCKET),
            *_kv_reader(s.ROUTERS_BUCKET),
            # Its own presence key only: a KV put, delete (on drain) and purge are all
            # publishes on `$KV.<bucket>.<key>`, told apart by a header.
            s.router_presence(router_id),
            f"{s.ROOT}.kvsnap.>",  # KV block snapshot requests to agents
            s.demand(router_id),  # its own demand summary, the autoscaler's input (core NATS)
        ]
        subscribe = [
            inbox,
            s.LOAD_ALL,
            s.KV_EVENTS_ALL,
            f"$KV.{s.ENDPOINTS_BUCKET}.>",
            f"$KV.{s.TENANTS_BUCKET}.>",
            f"$KV.{s.ROUTERS_BUCKET}.>",
        ]
        return {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}
    if ident.role == "reconciler":
        publish = [f"{s.ROOT}.>", f"{API}.>", "$KV.>", "$JS.ACK.>", "$JS.FC.>"]
        subscribe = [inbox, f"{s.ROOT}.>", "$KV.>"]
        return {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}
    if ident.role == "operator":
        publish = [
            f"{s.ROOT}.evt.catalog.>",
            *_COMMON_PUBLISH,
            *_stream_reader(s.EVENTS_STREAM),
            f"{API}.STREAM.INFO.{s.HEARTBEATS_STREAM}",
            f"{API}.STREAM.INFO.{s.COMMANDS_STREAM}",
            *_kv_reader(s.ENDPOINTS_BUCKET),
            *_kv_reader(s.TENANTS_BUCKET),
            *_kv_reader(s.ROUTERS_BUCKET),
        ]
        return {"publish": {"allow": publish}, "subscribe": {"allow": [inbox]}}
    raise CertError(f"identity {ident.name!r} has an unknown role {ident.role!r}")


def _agent_streams() -> list[str]:
    # To check at start that the control plane has provisioned what it needs.
    return [s.EVENTS_STREAM, s.HEARTBEATS_STREAM, s.COMMANDS_STREAM]


def users(identities: list[Identity]) -> list[dict]:
    return [{"user": i.subject, "permissions": permissions(i)} for i in identities]


# ---------------------------------------------------------------- rendering


def _value(v, indent: int) -> str:
    pad = "  " * indent
    if isinstance(v, dict):
        inner = "".join(f"{pad}  {k}: {_value(x, indent + 1)}\n" for k, x in v.items())
        return "{\n" + inner + pad + "}"
    if isinstance(v, list):
        if len(v) <= 2 and all(not isinstance(x, dict | list) for x in v):
            return "[" + ", ".join(_value(x, indent) for x in v) + "]"
        inner = "".join(f"{pad}  {_value(x, indent + 1)}\n" for x in v)
        return "[\n" + inner + pad + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v)
    # JSON string quoting is valid NATS config quoting; quoted "$..." is never a variable.
    return json.dumps(str(v))


def render_authorization(identities: list[Identity]) -> str:
    return "authorization " + _value({"users": users(identities)}, 0) + "\n"


def render_helm_values(identities: list[Identity]) -> str:
    """Values for the NATS chart (1.x), merged into its generated server config."""
    head = (
        "# Generated by `llmgw nats-config --format helm-values`: one user per certificate.\n"
        "# helm upgrade --install nats nats/nats -f deploy/k8s/nats/values.yaml -f THIS_FILE\n"
    )
    values = {"config": {"merge": {"authorization": {"users": users(identities)}}}}
    return head + yaml.safe_dump(values, sort_keys=False, width=100)


def render(
    identities: list[Identity],
    tls_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 4222,
    store_dir: str = "./jetstream",
    monitor_port: int | None = None,
    server_name: str | None = None,
) -> str:
    tls_dir = tls_dir.rstrip("/") or "/"
    top: dict = {"listen": f"{host}:{port}"}
    if server_name:
        top["server_name"] = server_name
    if monitor_port:
        top["http"] = f"{host}:{monitor_port}"
    top["jetstream"] = {"store_dir": store_dir}
    top["tls"] = {
        "cert_file": f"{tls_dir}/{SERVER_NAME}.crt",
        "key_file": f"{tls_dir}/{SERVER_NAME}.key",
        "ca_file": f"{tls_dir}/{CA_NAME}.crt",
        "verify_and_map": True,
        "timeout": 2,
    }
    head = "# Generated by `llmgw nats-config`: edit the generator, not this file.\n"
    body = "".join(f"{k}: {_value(v, 0)}\n" for k, v in top.items())
    return head + body + render_authorization(identities)


# ---------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--certs", required=True, type=Path, help="folder made by `llmgw certs init`"
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="config file to write ('-': stdout)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=4222, help="client port (default 4222)")
    parser.add_argument("--monitor-port", type=int, default=None, help="HTTP monitoring port")
    parser.add_argument("--store-dir", default="./jetstream", help="JetStream storage folder")
    parser.add_argument("--server-name", default=None, help="server_name (unique in a cluster)")
    parser.add_argument(
        "--tls-dir",
        default=None,
        help="where the server will find the PEM files, if not where --certs is "
        "(e.g. a mounted secret in a container)",
    )
    parser.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="NAME",
        help="a router identity whose certificate is issued elsewhere, one per pod (e.g. "
        "router-llmgw-router-0 from cert-manager's csi-driver): its user, with no file in "
        "--certs; repeat for each",
    )
    parser.add_argument(
        "--format",
        choices=["conf", "helm-values"],
        default="conf",
        help="conf: a whole nats-server config (default); helm-values: only the users, "
        "as values for the official NATS Helm chart (config.merge.authorization)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        found = read_identities(args.certs)
        for name in args.router:
            ident = identity_from_name(name)
            if ident.role != "router":
                raise CertError(f"--router {name}: not a router identity (router-<id>)")
            if ident not in found:
                found.append(ident)
    except CertError as exc:
        print(f"llmgw nats-config: {exc}", file=sys.stderr)
        return 1
    if not (args.certs / f"{CA_NAME}.crt").exists():
        print(
            f"llmgw nats-config: {args.certs} has no {CA_NAME}.crt: run `llmgw certs init` first",
            file=sys.stderr,
        )
        return 1
    if not found:
        print(f"llmgw nats-config: no client certificates in {args.certs}", file=sys.stderr)
        return 1
    if args.format == "helm-values":
        text = render_helm_values(found)
    else:
        text = render(
            found,
            args.tls_dir or str(args.certs.resolve()),
            host=args.host,
            port=args.port,
            store_dir=args.store_dir,
            monitor_port=args.monitor_port,
            server_name=args.server_name,
        )
    if str(args.out) == "-":
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out} ({len(found)} identities: {', '.join(i.name for i in found)})")
    return 0
