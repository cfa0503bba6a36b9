"""The reconciler's configuration: defaults < YAML file < LLMGW_* environment < CLI flags."""

from __future__ import annotations

import math
import os
import socket

import msgspec

from llmgw import bus, config, tlsconfig
from llmgw.reconciler import leader
from llmgw.reconciler.api import auth
from llmgw.reconciler.controllers.manager import ActorConfig
from llmgw.reconciler.store import schema


class FoldConfig(config.ConfigStruct, kw_only=True):
    batch_size: int = 500  # messages per fetch, and per transaction at most
    fetch_wait_seconds: float = 0.5  # how long an empty fetch waits for new events
    ack_wait_seconds: float = 30.0  # redelivery of fetched, unacknowledged events


class LeaderConfig(config.ConfigStruct, kw_only=True):
    lock_id: int = leader.DEFAULT_LOCK_ID  # the advisory lock every reconciler competes for
    retry_interval_seconds: float = 1.0  # how often a standby tries the lock
    check_interval_seconds: float = 1.0  # how often the leader checks the lock's connection
    # Postgres ends the lock's session after this long without a word from the leader (a
    # frozen network path): a standby can lead then. The leader steps down sooner, after
    # one check unanswered for check_interval_seconds.
    session_timeout_seconds: float = leader.DEFAULT_SESSION_TIMEOUT


class ReconcilerConfig(config.ConfigStruct, kw_only=True):
    id: str = ""  # "" -> <hostname>-<pid>
    nats_url: str = "nats://127.0.0.1:4222"  # comma-separated for a cluster
    nats_tls: tlsconfig.NatsTLS = msgspec.field(default_factory=tlsconfig.NatsTLS)
    database_url: str = schema.DEFAULT_DATABASE_URL
    admin_listen: str = "127.0.0.1:9300"  # /metrics, /healthz, /readyz, the operator API
    # HTTPS on admin_listen, a client certificate signed by `ca` required of every caller
    # (probes and /metrics too); tokens still decide the API role.
    admin_tls: tlsconfig.AdminTLS = msgspec.field(default_factory=tlsconfig.AdminTLS)
    # Who may call /api/ (api/auth.py): `tokens` (with none listed, every call is refused)
    # or `none`, no check at all, allowed only on a loopback admin_listen.
    api_auth: str = auth.AUTH_TOKENS
    api_tokens: list[auth.ApiToken] = msgspec.field(default_factory=list)
    log_level: str = "info"
    bus: bus.BusConfig = msgspec.field(default_factory=bus.BusConfig)
    fold: FoldConfig = msgspec.field(default_factory=FoldConfig)
    leader: LeaderConfig = msgspec.field(default_factory=LeaderConfig)
    actor: ActorConfig = msgspec.field(default_factory=ActorConfig)


def resolve_id(cfg: ReconcilerConfig) -> str:
    return cfg.id or f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def validate(cfg: ReconcilerConfig) -> list[str]:
    """Problems a decoder cannot see, each naming its key."""
    problems = []
    if not 1 <= cfg.fold.batch_size <= 10_000:
        problems.append(f"fold.batch_size = {cfg.fold.batch_size}: must be 1..10000")
    if cfg.fold.fetch_wait_seconds <= 0:
        problems.append("fold.fetch_wait_seconds: must be > 0")
    if cfg.leader.retry_interval_seconds <= 0 or cfg.leader.check_interval_seconds <= 0:
        problems.append("leader.*_interval_seconds: must be > 0")
    elif cfg.leader.session_timeout_seconds < 3 * cfg.leader.check_interval_seconds:
        problems.append(
            f"leader.session_timeout_seconds = {cfg.leader.session_timeout_seconds}: must be at "
            "least 3 x leader.check_interval_seconds, so a cut-off leader steps down before "
            "Postgres frees the lock for another"
        )
    for name in ("autoscale_tick", "lora_tick"):
        tick = getattr(cfg.actor, name)
        if not (math.isfinite(tick) and tick > 0):
            problems.append(f"actor.{name} = {tick}: must be a number > 0")
    try:
        host, _ = config.host_port(cfg.admin_listen, 9300)
    except config.ConfigError as exc:
        problems.append(f"admin_listen: {exc}")
    else:
        problems += auth.config_problems(cfg.api_auth, cfg.api_tokens, host)
    try:  # unreadable or mismatched certificates fail at start, not at the first connect
        tlsconfig.nats_options(cfg.nats_tls)
    except config.ConfigError as exc:
        problems.append(str(exc))
    try:
        tlsconfig.admin_server_options(cfg.admin_tls)
    except config.ConfigError as exc:
        problems.append(str(exc))
    return problems
