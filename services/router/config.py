"""The router's config file (router-only mode) and its validation.

Models and endpoints in the file are turned into the same per-model records
the control plane publishes (`contracts.ModelEndpoints`), so both modes feed
one endpoint view and share one shape for scheduling and deadlines.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from llmgw import certs, tlsconfig
from llmgw import config as cfg
from llmgw.contracts import (
    PD_ROLES,
    DeadlineSpec,
    DisaggregationSpec,
    Endpoint,
    EndpointState,
    MigrationSpec,
    ModelEndpoints,
    SchedulingSpec,
    UpstreamSpec,
)
from llmgw.router.admission import config as admission
from llmgw.router.endpoints import routes
from llmgw.router.scheduling.prefix import PrefixConfig


class ModelConfig(cfg.ConfigStruct):
    name: str
    aliases: list[str] = msgspec.field(default_factory=list)
    # Tried in order when every endpoint of this model fails before the first byte.
    fallbacks: list[str] = msgspec.field(default_factory=list)
    scheduling: SchedulingSpec | None = None  # None: model_defaults.scheduling
    deadlines: DeadlineSpec | None = None  # None: model_defaults.deadlines
    upstream: UpstreamSpec = msgspec.field(default_factory=UpstreamSpec)  # headers to engines
    owned_by: str = ""  # GET /v1/models says so
    api_kinds: list[str] = msgspec.field(default_factory=list)  # empty: every API kind
    max_model_len: int | None = None  # GET /v1/models says so; else asked of the engines
    migration: MigrationSpec = msgspec.field(default_factory=MigrationSpec)  # docs/router.md
    # Set: the model's endpoints carry roles (prefill | decode) and requests take the
    # two-leg route (docs/disaggregation.md).
    disaggregation: DisaggregationSpec | None = None


class EndpointConfig(cfg.ConfigStruct):
    id: str
    url: str
    models: list[str]
    engine: str = "vllm"  # vllm | sglang | sim: which metric names its /metrics has
    node: str = ""
    state: EndpointState = EndpointState.READY
    max_running: int | None = None
    upstream: UpstreamSpec = msgspec.field(default_factory=UpstreamSpec)  # headers to it
    role: str = ""  # prefill | decode: its pool in a disaggregated model; "": aggregated


class ModelDefaults(cfg.ConfigStruct):
    scheduling: SchedulingSpec = msgspec.field(default_factory=SchedulingSpec)
    deadlines: DeadlineSpec = msgspec.field(default_factory=DeadlineSpec)


class RetryConfig(cfg.ConfigStruct):
    # Endpoints tried per model (each a different one) before walking the fallbacks.
    attempts_per_model: int = 3


class CircuitConfig(cfg.ConfigStruct):
    failures: int = 5  # consecutive connect errors, 5xx or deadline misses that open it
    cooldown_seconds: float = 10.0  # open this long, then one probe request decides


class ScrapeConfig(cfg.ConfigStruct):
    enabled: bool = True
    interval_seconds: float = 0.2
    timeout_seconds: float = 1.0
    # Load older than this is stale: the queue and KV scorers then rate the endpoint
    # as worst, so fresh endpoints win while the router's own in-flight count and
    # affinity still spread traffic among stale ones.
    stale_after_seconds: float = 1.0
    # Control-plane mode: the agents' load samples come first and an endpoint is
    # scraped only while its samples are stale (agent down, NATS unreachable).
    # False: scrape every endpoint always, as in router-only mode.
    fallback_only: bool = True


class UpstreamConfig(cfg.ConfigStruct):
    pool_limit: int = 4096  # open connections per worker, all endpoints together
    keepalive_seconds: float = 30.0


class CorsConfig(cfg.ConfigStruct):
    """Cross-origin access for browser clients; off while allow_origins is empty."""

    allow_origins: list[str] = msgspec.field(default_factory=list)  # ["*"]: any origin
    # Request headers a browser may send; ["*"]: whatever its preflight asks for.
    allow_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    max_age_seconds: int = 600


class RouterConfig(cfg.ConfigStruct):
    # Non-empty: control-plane mode. Models, endpoints, tenants and bands come from the
    # reconciler's KV buckets and must not be in this file (docs/router.md).
    nats_url: str = ""
    nats_tls: tlsconfig.NatsTLS = msgspec.field(default_factory=tlsconfig.NatsTLS)
    # This router's name in the presence bucket; empty: the one its NATS client certificate
    # names, else <hostname>-<pid> (resolve_router_id).
    router_id: str = ""
    listen: str = "127.0.0.1:8080"
    admin_listen: str = "127.0.0.1:9090"
    workers: int = 1
    log_level: str = "info"
    access_log: bool = False  # one line per request; failures are always logged
    max_body_bytes: int = 8 * 1024 * 1024
    # A client must finish sending its body this soon after its headers, else 408.
    body_read_timeout_seconds: float = 30.0
    shutdown_grace_seconds: float = 30.0
    models: list[ModelConfig] = msgspec.field(default_factory=list)
    endpoints: list[EndpointConfig] = msgspec.field(default_factory=list)
    model_defaults: ModelDefaults = msgspec.field(default_factory=ModelDefaults)
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    circuit: CircuitConfig = msgspec.field(default_factory=CircuitConfig)
    scrape: ScrapeConfig = msgspec.field(default_factory=ScrapeConfig)
    prefix: PrefixConfig = msgspec.field(default_factory=PrefixConfig)
    upstream: UpstreamConfig = msgspec.field(default_factory=UpstreamConfig)
    cors: CorsConfig = msgspec.field(default_factory=CorsConfig)
    # Admission control (docs/admission.md): bands highest priority first.
    admission: admission.AdmissionSettings = msgspec.field(
        default_factory=admission.AdmissionSettings
    )
    bands: list[admission.BandConfig] = msgspec.field(default_factory=list)
    tenants: list[admission.TenantConfig] = msgspec.field(default_factory=list)


# Sections whose structs come from contracts, which (for forward compatibility on
# the wire) accept unknown keys: check them here so a typo fails at start.
_CONTRACT_SECTIONS = {"scheduling": SchedulingSpec, "deadlines": DeadlineSpec}


def _unknown_keys(raw: dict[str, Any]) -> list[str]:
    problems = []
    places: list[tuple[str, Any]] = [("model_defaults", raw.get("model_defaults"))]
    models = raw.get("models")
    if isinstance(models, list):
        places += [(f"models[{i}]", m) for i, m in enumerate(models)]
    for where, section in places:
        if not isinstance(section, dict):
            continue
        for key, struct in _CONTRACT_SECTIONS.items():
            value = section.get(key)
            if not isinstance(value, dict):
                continue
            known = {f.encode_name for f in msgspec.structs.fields(struct)}
            for k in value:
                if k not in known:
                    problems.append(
                        f"{where}.{key}.{k}: unknown key (known: {', '.join(sorted(known))})"
                    )
    return problems


def validate(config: RouterConfig) -> list[str]:
    """Every problem in the file, each naming the entry; empty when it is valid."""
    problems = []
    if config.workers < 1:
        problems.append(f"workers = {config.workers}: must be at least 1")
    if config.max_body_bytes < 1024:
        problems.append(f"max_body_bytes = {config.max_body_bytes}: must be at least 1024")
    for field, value in (
        ("retry.attempts_per_model", config.retry.attempts_per_model),
        ("circuit.failures", config.circuit.failures),
        ("prefix.block_bytes", config.prefix.block_bytes),
        ("prefix.max_blocks", config.prefix.max_blocks),
        ("prefix.capacity_blocks", config.prefix.capacity_blocks),
        ("prefix.index_max_blocks", config.prefix.index_max_blocks),
        ("upstream.pool_limit", config.upstream.pool_limit),
    ):
        if value < 1:
            problems.append(f"{field} = {value}: must be at least 1")
    for field, value in (
        ("body_read_timeout_seconds", config.body_read_timeout_seconds),
        ("circuit.cooldown_seconds", config.circuit.cooldown_seconds),
        ("scrape.interval_seconds", config.scrape.interval_seconds),
        ("scrape.timeout_seconds", config.scrape.timeout_seconds),
        ("scrape.stale_after_seconds", config.scrape.stale_after_seconds),
    ):
        if value <= 0:
            problems.append(f"{field} = {value}: must be positive")
    for listen in ("listen", "admin_listen"):
        try:
            cfg.host_port(getattr(config, listen), 0)
        except cfg.ConfigError as exc:
            problems.append(f"{listen}: {exc}")

    seen: dict[str, int] = {}
    for i, ep in enumerate(config.endpoints):
        where = f"endpoints[{i}] (id {ep.id!r})"
        if ep.id in seen:
            problems.append(
                f"{where}: duplicate endpoint id, first used by endpoints[{seen[ep.id]}]"
            )
        else:
            seen[ep.id] = i
        parts = urlsplit(ep.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(f"{where}: url {ep.url!r} is not an http(s) URL with a host")
        if not ep.models:
            problems.append(f"{where}: serves no models (models is empty)")
        if ep.role and ep.role not in PD_ROLES:
            problems.append(
                f"{where}: role {ep.role!r} is not one of {', '.join(PD_ROLES)} (or empty)"
            )
    for i, m in enumerate(config.models):
        if m.migration.max < 0:
            problems.append(
                f"models[{i}] ({m.name!r}): migration.max = {m.migration.max}: "
                "must be 0 (off) or more"
            )
    declared = {m.name for m in config.models}
    for i, ep in enumerate(config.endpoints):
        for model in ep.models:
            if model not in declared:
                problems.append(
                    f"endpoints[{i}] (id {ep.id!r}): serves unknown model {model!r} (not in models)"
                )
    if config.nats_url:
        problems += _control_plane_problems(config)
    else:
        problems += routes.check(projection(config))
        problems += admission.check(config.admission, config.bands, config.tenants)
    return problems


def _control_plane_problems(config: RouterConfig) -> list[str]:
    # One source of truth: merging file entries with the catalog would let two routers
    # behind one load balancer serve different models and tenants without anyone noticing.
    problems = [
        f"{key}: not allowed with nats_url (control-plane mode takes models, endpoints, "
        "tenants and bands from the control plane's KV buckets); remove it or unset nats_url"
        for key in ("models", "endpoints", "tenants", "bands")
        if getattr(config, key)
    ]
    if config.admission.routers != 1:
        problems.append(
            f"admission.routers = {config.admission.routers}: not allowed with nats_url "
            "(the live router count comes from the presence bucket)"
        )
    problems += [
        p
        for p in admission.check(config.admission, [], [])
        if not p.startswith("admission.anonymous_tenant")  # its tenant comes from the catalog
    ]
    if config.nats_tls.enabled:
        try:
            tlsconfig.nats_options(config.nats_tls)
            _certificate_router_id(config)
        except cfg.ConfigError as exc:
            problems.append(str(exc))
    return problems


def _certificate_router_id(config: RouterConfig) -> str | None:
    """The router id this router's NATS client certificate names (None without one).

    NATS lets a router identity put only its own presence key and publish only its own
    demand subject (llmgw.natsconfig), so a router under another id would be refused on
    every announcement: a configured router_id that differs is an error at start.
    """
    name = tlsconfig.identity(config.nats_tls)
    if name is None:
        return None
    try:
        named = certs.identity_from_name(name).router_id
    except certs.CertError:
        named = None
    if named is None:
        raise cfg.ConfigError(
            f"nats_tls.cert = {config.nats_tls.cert!r} is the certificate of {name!r}, "
            "not of a router (router-<n>)"
        )
    if config.router_id and config.router_id != named:
        raise cfg.ConfigError(
            f"router_id = {config.router_id!r} but nats_tls.cert = {config.nats_tls.cert!r} "
            f"names router {named!r}, the only id NATS lets this router announce and publish "
            f"demand as: set router_id to {named!r} or leave it unset (it then comes from "
            "the certificate)"
        )
    return named


def resolve_router_id(config: RouterConfig) -> RouterConfig:
    """The config with router_id set: the one its NATS client certificate names, if it
    has one (a different configured one raises ConfigError), else the configured one,
    else <hostname>-<pid>. Call it once in the process that owns the router, before
    workers start, so they all share the one id."""
    named = _certificate_router_id(config)
    if named is not None:
        return msgspec.structs.replace(config, router_id=named)
    if config.router_id:
        return config
    return msgspec.structs.replace(config, router_id=f"{socket.gethostname()}-{os.getpid()}")


def _effective(config: RouterConfig, model: ModelConfig) -> tuple[SchedulingSpec, DeadlineSpec]:
    return (
        model.scheduling or config.model_defaults.scheduling,
        model.deadlines or config.model_defaults.deadlines,
    )


def projection(config: RouterConfig) -> list[ModelEndpoints]:
    """The file's models and endpoints as the records the control plane would publish."""
    by_model: dict[str, list[Endpoint]] = {m.name: [] for m in config.models}
    for ep in config.endpoints:
        for model in ep.models:
            by_model.setdefault(model, []).append(
                Endpoint(
                    id=ep.id,
                    url=ep.url.rstrip("/"),
                    node=ep.node,
                    state=ep.state,
                    engine=ep.engine,
                    max_running=ep.max_running,
                    upstream=ep.upstream,
                    role=ep.role,
                )
            )
    records = []
    for m in config.models:
        scheduling, deadlines = _effective(config, m)
        records.append(
            ModelEndpoints(
                model=m.name,
                endpoints=by_model[m.name],
                aliases=list(m.aliases),
                fallbacks=list(m.fallbacks),
                scheduling=scheduling,
                deadlines=deadlines,
                upstream=m.upstream,
                owned_by=m.owned_by,
                api_kinds=list(m.api_kinds),
                max_model_len=m.max_model_len,
                migration=m.migration,
                disaggregation=m.disaggregation,
            )
        )
    return records


def _fill_from_defaults(config: RouterConfig, raw: dict[str, Any]) -> None:
    """A model's scheduling/deadlines keys override model_defaults key by key.

    After decoding, a model's section is a whole struct whose unset keys hold the
    built-in defaults; the raw file tells which keys the operator actually wrote.
    """
    raw_models = raw.get("models") if isinstance(raw.get("models"), list) else []
    for i, model in enumerate(config.models):
        raw_model = raw_models[i] if i < len(raw_models) and isinstance(raw_models[i], dict) else {}
        for key in _CONTRACT_SECTIONS:
            own = getattr(model, key)
            written = raw_model.get(key)
            if own is None or not isinstance(written, dict):
                continue
            base = getattr(config.model_defaults, key)
            explicit = {k: getattr(own, k) for k in written if hasattr(own, k)}
            setattr(model, key, msgspec.structs.replace(base, **explicit))


def load(path: str | Path | None, overrides: dict[str, Any] | None = None) -> RouterConfig:
    """Load and validate; raises ConfigError listing every problem."""
    config = cfg.load(RouterConfig, path, overrides=overrides)
    raw = cfg.read_yaml(path) if path else {}
    _fill_from_defaults(config, raw)
    problems = _unknown_keys(raw)
    problems += validate(config)
    if problems:
        source = str(path) if path else "config"
        raise cfg.ConfigError(f"{source}:\n" + "\n".join(f"  - {p}" for p in problems))
    return config
