"""`llmgw agent`: run the node agent (or print this node's inventory and exit)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import msgspec

from llmgw import adminserver, config, logs

from . import engines as engine_detect
from .agent import Agent
from .config import (
    ADMIN_PORT,
    AgentConfig,
    parse_labels,
    parse_port_range,
    resolve_node_id,
    resolve_state_dir,
)
from .inventory import InventoryError, discover
from .state import StateDir, StateDirBusy

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file")
    parser.add_argument("--node-id", help="this node's id (default: the host name)")
    parser.add_argument("--nats", metavar="URL", help="NATS server URL(s), comma-separated")
    parser.add_argument(
        "--admin-listen",
        metavar="HOST:PORT",
        help=f"address for /metrics, /healthz, /readyz (default 127.0.0.1:{ADMIN_PORT}; '' = off)",
    )
    parser.add_argument("--labels", metavar="K=V,...", help="node labels, e.g. fabric=ib-a,zone=z1")
    parser.add_argument(
        "--fake-gpus",
        metavar="SPEC",
        help="simulated GPUs instead of NVML, e.g. 8x80GiB or 2x141GB:H200,2x24GiB",
    )
    parser.add_argument("--engine-port-range", metavar="FIRST-LAST", help="e.g. 8100-8199")
    parser.add_argument("--state-dir", metavar="DIR", help="where launched engines are recorded")
    parser.add_argument(
        "--advertise-address",
        metavar="HOST",
        help="the address routers reach this node's engines at (default 127.0.0.1)",
    )
    parser.add_argument("--heartbeat-interval", type=float, metavar="SECONDS")
    parser.add_argument("--load-interval", type=float, metavar="SECONDS")
    parser.add_argument("--log-level", help="debug, info, warning, error")
    parser.add_argument(
        "--inventory",
        action="store_true",
        help="print this node's inventory (as registration would carry it) as JSON and exit",
    )


def load_config(args: argparse.Namespace) -> AgentConfig:
    overrides = {
        "node_id": args.node_id,
        "nats": args.nats,
        "admin_listen": args.admin_listen,
        "labels": parse_labels(args.labels) if args.labels is not None else None,
        "fake_gpus": args.fake_gpus,
        "engine_port_range": args.engine_port_range,
        "state_dir": args.state_dir,
        "advertise_address": args.advertise_address,
        "heartbeat_interval_seconds": args.heartbeat_interval,
        "load_interval_seconds": args.load_interval,
        "log_level": args.log_level,
    }
    cfg = config.load(AgentConfig, args.config, overrides=overrides)
    parse_port_range(cfg.engine_port_range)  # fail at start, not at the first launch
    if cfg.admin_listen:
        try:
            config.host_port(cfg.admin_listen, ADMIN_PORT)
        except config.ConfigError as exc:
            raise config.ConfigError(f"admin_listen: {exc}") from None
    for name in ("heartbeat_interval_seconds", "load_interval_seconds", "ready_poll_seconds"):
        if getattr(cfg, name) <= 0:
            raise config.ConfigError(f"{name} = {getattr(cfg, name)!r}: must be positive")
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args)
        node = resolve_node_id(cfg)
    except config.ConfigError as exc:
        print(f"llmgw agent: {exc}", file=sys.stderr)
        return 2
    logs.setup("agent", cfg.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per probe and scrape otherwise
    try:
        inventory = discover(node, cfg.fake_gpus, cfg.advertise_address)
    except InventoryError as exc:
        print(f"llmgw agent: refusing to start: {exc}", file=sys.stderr)
        return 1
    found = engine_detect.detect(cfg)
    if args.inventory:
        agent = Agent(cfg, node, inventory, StateDir(resolve_state_dir(cfg, node)), found)
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(agent.registration())).decode())
        sys.stdout.write("\n")
        return 0
    for name, why in sorted(found.items()):
        if why is None:
            log.info("engine %s: available", name)
        else:
            log.info("engine %s: unavailable (%s)", name, why)
    try:
        state_dir = StateDir(resolve_state_dir(cfg, node)).open()
    except (StateDirBusy, OSError) as exc:
        print(f"llmgw agent: {exc}", file=sys.stderr)
        return 1
    try:
        asyncio.run(_main(Agent(cfg, node, inventory, state_dir, found)))
    except adminserver.ListenError as exc:
        print(f"llmgw agent: admin_listen: {exc.strerror}", file=sys.stderr)
        return 1
    finally:
        state_dir.close()
    return 0


async def _main(agent: Agent) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop)
    log.info(
        "agent %s starting: %d GPU(s), labels %s",
        agent.node,
        len(agent.inventory.gpus),
        agent.cfg.labels,
    )
    await agent.run()
    log.info("agent %s stopped", agent.node)
