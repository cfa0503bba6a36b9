"""`llmgw router`: run an OpenAI-compatible router (router-only mode: endpoints from the file)."""

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
    parser.add_argument("--log-level", help="debug, info, warning, error")
    parser.add_argument("--check", action="store_true", help="validate the config file and exit")


def run(args: argparse.Namespace) -> int:
    from llmgw.router import config as router_config

    overrides = {
        "listen": args.listen,
        "admin_listen": args.admin_listen,
        "workers": args.workers,
        "log_level": args.log_level,
    }
    try:
        config = router_config.load(args.config, overrides)
    except ConfigError as exc:
        print(f"llmgw router: invalid config: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(
            f"config ok: {len(config.models)} models, {len(config.endpoints)} endpoints",
            file=sys.stderr,
        )
        return 0
    logs.setup("router", config.log_level)
    if not config.endpoints:
        log.warning("no endpoints configured: every request will get 404 or 503")
    log.info(
        "router starting",
        extra={
            "listen": config.listen,
            "admin_listen": config.admin_listen,
            "workers": config.workers,
            "models": len(config.models),
            "endpoints": len(config.endpoints),
        },
    )
    from llmgw.router import server

    if config.workers > 1:
        return server.serve_workers(config)
    uvloop.run(server.serve_single(config))
    return 0
