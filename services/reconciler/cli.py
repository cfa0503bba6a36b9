"""`llmgw reconciler`: run one reconciler process (leader or standby)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from llmgw import config, logs
from llmgw.reconciler.config import ReconcilerConfig, validate


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file")
    parser.add_argument("--nats", dest="nats_url", help="NATS URL(s), comma-separated")
    parser.add_argument("--database-url", help="PostgreSQL URL (postgresql+asyncpg://...)")
    parser.add_argument("--admin-listen", help="host:port for /metrics, probes and the API")
    parser.add_argument(
        "--api-auth",
        choices=("tokens", "none"),
        help="who may call /api/: holders of api_tokens (default), or anyone (loopback only)",
    )
    parser.add_argument("--id", help="this process's name in logs and /readyz")
    parser.add_argument("--log-level", help="debug | info | warning | error")


async def _serve(cfg: ReconcilerConfig) -> int:
    from llmgw.reconciler.service import Reconciler

    rec = Reconciler(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rec.stop.set)
    return await rec.run()


def run(args: argparse.Namespace) -> int:
    overrides = {
        "nats_url": args.nats_url,
        "database_url": args.database_url,
        "admin_listen": args.admin_listen,
        "api_auth": args.api_auth,
        "id": args.id,
        "log_level": args.log_level,
    }
    try:
        cfg = config.load(ReconcilerConfig, args.config, overrides=overrides)
    except config.ConfigError as exc:
        print(f"llmgw reconciler: {exc}", file=sys.stderr)
        return 2
    problems = validate(cfg)
    if problems:
        for problem in problems:
            print(f"llmgw reconciler: {problem}", file=sys.stderr)
        return 2
    logs.setup("reconciler", cfg.log_level)
    return asyncio.run(_serve(cfg))
