"""`llmgw router`: run an OpenAI-compatible router.

Router-only mode takes models, endpoints and tenants from the file; with
`nats_url` (control-plane mode) they come from the reconciler's KV buckets.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvloop

from llmgw import logs
from llmgw.config import ConfigError

log = logging.getLogger("llmgw.router")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="router YAML file (see docs/router.md)")
    parser.add_argument("--listen", help="public address, host:port (default 127.0.0.1:8080)")
    parser.add_argument("--admin-listen", help="admin address for /metrics, /healthz ...")
    parser.add_argument("--workers", type=int, help="worker processes (default 1)")
    parser.add_argument(
        "--nats-url", help="control-plane mode: endpoints and tenants from this NATS"
    )
    parser.add_argument(
        "--router-id",
        help="name in the presence bucket (default: the router nats_tls.cert names, else host-pid)",
    )
    parser.add_argument("--log-level", help="debug, info, warning, error")
    parser.add_argument("--check", action="store_true", help="validate the config file and exit")


def run(args: argparse.Namespace) -> int:
    from llmgw.router import config as router_config

    overrides = {
        "listen": args.listen,
        "admin_listen": args.admin_listen,
        "workers": args.workers,
        "log_level": args.log_level,
        "nats_url": args.nats_url,
        "router_id": args.router_id,
    }
    try:
        config = router_config.load(args.config, overrides)
    except ConfigError as exc:
        print(f"llmgw router: invalid config: {exc}", file=sys.stderr)
        return 2
    if args.check:
        what = (
            f"control-plane mode, NATS at {config.nats_url}"
            if config.nats_url
            else f"{len(config.models)} models, {len(config.endpoints)} endpoints"
        )
        print(f"config ok: {what}", file=sys.stderr)
        return 0
    logs.setup("router", config.log_level)
    # Once, here: every worker process shares this id in the presence bucket.
    config = router_config.resolve_router_id(config) if config.nats_url else config
    if not config.endpoints and not config.nats_url:
        log.warning("no endpoints configured: every request will get 404 or 503")
    mode = (
        {"nats_url": config.nats_url, "router_id": config.router_id}
        if config.nats_url
        else {"models": len(config.models), "endpoints": len(config.endpoints)}
    )
    log.info(
        "router starting",
        extra={
            "listen": config.listen,
            "admin_listen": config.admin_listen,
            "workers": config.workers,
            **mode,
        },
    )
    from llmgw.router import server

    if config.workers > 1:
        return server.serve_workers(config)
    uvloop.run(server.serve_single(config))
    return 0
