"""The router's in-memory view of models and endpoints, and where it is fed from.

One `EndpointView` holds what the hot path reads: name -> model route, each
route's endpoints with their live state (load, circuit, in-flight, prefix
index). An `EndpointSource` feeds it: in router-only mode the config file,
once (`StaticSource`); with a control plane, a watcher of the projection in
JetStream KV that calls `replace`/`apply`/`remove` as records change
(controlplane.ControlPlaneSource).
Updates swap whole route objects, so a request in flight keeps the consistent
snapshot it resolved, and per-endpoint state survives updates by endpoint id.

A LoRA adapter declared on a model gets a route of its own, named for the adapter (what
requests and engines call it): its endpoints are the model's that hold the adapter now,
per their agents, and its requests wait in admission while there are none, as a model
scaled to zero waits for a replica, since only the control plane's placement loads one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from yarl import URL

from llmgw import projection
from llmgw.contracts import (
    DeadlineSpec,
    Endpoint,
    EndpointState,
    ModelEndpoints,
    UpstreamSpec,
)
from llmgw.router.endpoints import routes
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.problemlog import ProblemLog
from llmgw.router.relay.circuit import Circuit
from llmgw.router.request.body import PATHS
from llmgw.router.scheduling import lora
from llmgw.router.scheduling import pipeline as scheduling
from llmgw.router.scheduling.prefix import PrefixIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ViewSettings:
    circuit_failures: int = 5
    circuit_cooldown: float = 10.0
    scheduling: scheduling.Settings = scheduling.Settings()


class EndpointRuntime:
    """One engine endpoint and what this router process knows about it right now."""

    __slots__ = (
        "id",
        "url",
        "spec",
        "models",
        "state",
        "circuit",
        "load",
        "inflight",
        "prefix_index",
        "scrape_error",
        "targets",
        "pushed_at",
        "headers",
        "uncached_tokens",
        "prefilling",
        "adapters",
    )

    def __init__(self, spec: Endpoint, settings: ViewSettings):
        self.id = spec.id
        self.url = spec.url.rstrip("/")
        self.spec = spec
        self.models: frozenset[str] = frozenset()
        self.state = spec.state
        self.circuit = Circuit(settings.circuit_failures, settings.circuit_cooldown)
        self.load: Load | None = None
        self.inflight = 0
        # Block hashes of the prompts this router sent here: the approximate scorers'
        # guess at what the engine caches.
        self.prefix_index = PrefixIndex(settings.scheduling.prefix.capacity_blocks)
        self.scrape_error: str | None = None
        # request path -> upstream URL, parsed once (a new url makes a new runtime)
        self.targets = {path: URL(self.url + path) for path in PATHS}
        self.pushed_at = float("-inf")  # monotonic arrival of the latest agent load sample
        self.headers = resolve_headers(spec.upstream)  # added to every request to it
        # Uncached prompt tokens per request this router sent here (moving average): what
        # each queued request will cost the engine's prefill (kv_prefix).
        self.uncached_tokens = 0.0
        # This router's streamed requests here still waiting for their first event, and
        # prefill legs until their answer: their prefill is ahead of a request sent now
        # (kv_prefix).
        self.prefilling = 0
        self.adapters = frozenset(spec.adapters)  # the LoRA adapters its engine holds now

    def target(self, path: str) -> URL:
        url = self.targets.get(path)
        if url is None:  # a stored response's path: not worth keeping
            url = URL(self.url + path)
        return url

    def request_headers(
        self, route: ModelRoute | None, content_type: str | None, rid: bytes
    ) -> dict[str, str]:
        """The headers of a request to this endpoint: the model's upstream headers, then
        this endpoint's (the more specific wins)."""
        headers = {"Content-Type": content_type or "application/json", "X-Request-Id": rid.decode()}
        if route is not None and route.headers:
            headers.update(route.headers)
        if self.headers:
            headers.update(self.headers)
        return headers

    def describe(self, now: float, stale_after: float) -> dict:
        load = self.load
        out: dict[str, Any] = {
            "id": self.id,
            "url": self.url,
            "models": sorted(self.models),
            "state": self.state.value,
            "engine": self.spec.engine,
            "node": self.spec.node,
            "inflight": self.inflight,
            "prefilling": self.prefilling,
            "circuit": self.circuit.describe(now),
            "load": None,
            "load_age_s": None,
            "stale": True,
            "scrape_error": self.scrape_error,
            "prefix_blocks": len(self.prefix_index),
            "adapters": sorted(self.adapters),
            "role": self.spec.role,  # prefill | decode; "": aggregated
        }
        if load is not None:
            out["load"] = {
                "waiting": load.waiting,
                "running": load.running,
                "kv_usage": load.kv_usage,
                "source": load.source,
            }
            age = max(0.0, now - load.at)
            out["load_age_s"] = round(age, 3)
            out["stale"] = age > stale_after
        return out


def resolve_headers(spec: UpstreamSpec) -> dict[str, str]:
    """Static headers plus secrets read from this process's environment (a missing
    variable was reported when the record was checked: routes.upstream_problems)."""
    if not spec.headers and not spec.secret_headers:
        return {}
    out = dict(spec.headers)
    for name, env in spec.secret_headers.items():
        value = os.environ.get(env)
        if value is not None:
            out[name] = value
    return out


@dataclass(frozen=True, slots=True)
class ModelRoute:
    name: str
    endpoints: tuple[EndpointRuntime, ...]
    pipeline: scheduling.Pipeline  # its scheduling profiles (one by default) and their handler
    deadlines: DeadlineSpec
    fallbacks: tuple[str, ...]  # models to walk, in order, once this one has failed
    headers: dict[str, str] = field(default_factory=dict)  # to every engine of this model
    api_kinds: frozenset[str] = frozenset()  # empty: every kind
    record: ModelEndpoints | None = None

    def serves(self, kind: str) -> bool:
        return not self.api_kinds or kind in self.api_kinds

    # Autoscaled from zero: with no ready endpoint, requests wait in admission for one.
    scale_from_zero: bool = False
    unplaceable: str = ""  # why the next replica cannot be placed (the control plane's words)
    # An adapter's route: the model it is declared on, and the tenants that may use it
    # (empty: every tenant); "" for a model's own route.
    adapter_of: str = ""
    tenants: frozenset[str] = frozenset()

    def allows(self, caller: Any) -> bool:
        """Whether this caller (a `admission.seam.Caller`, None without tenants) may use
        the route: an adapter limited to some tenants is theirs alone."""
        if not self.tenants:
            return True
        return caller is not None and caller.owner in self.tenants

    migrations: int = 0  # continuations allowed per cut stream (relay/continuation.py)


class EndpointView:
    def __init__(
        self,
        settings: ViewSettings | None = None,
        observer: scheduling.Observer | None = None,
    ):
        self.settings = settings or ViewSettings()
        self.observer = observer
        self.version = 0
        self._records: dict[str, ModelEndpoints] = {}
        self._names: dict[str, str] = {}
        self._routes: dict[str, ModelRoute] = {}
        self._table = routes.RouteTable({}, {}, {})
        self._adapters: dict[str, ModelRoute] = {}  # by adapter name
        self._adapter_pipelines: dict[str, scheduling.Pipeline] = {}  # by model
        self.endpoints: dict[str, EndpointRuntime] = {}
        # The same endpoints by the id of the shard that serves each: load samples and
        # KV event batches name their shard.
        self.by_shard: dict[str, EndpointRuntime] = {}
        self._by_url: dict[str, EndpointRuntime] = {}
        self._listeners: list[Callable[[], None]] = []
        self._load_listeners: list[Callable[[EndpointRuntime], None]] = []
        self.problems = ProblemLog()
        self._judging: asyncio.TimerHandle | None = None

    # ----------------------------------------------------------- hot path reads

    def resolve(self, name: str) -> ModelRoute | None:
        """The route for a model name or alias, or an adapter's (routes.RouteTable.adapter)."""
        canonical = self._names.get(name)
        if canonical is not None:
            return self._routes.get(canonical)
        adapter = self._table.adapter(name) if self._adapters else None
        return None if adapter is None else self._adapters.get(adapter)

    def route(self, model: str) -> ModelRoute | None:
        """A model's route, or an adapter's by its name."""
        route = self._routes.get(model)
        return route if route is not None else self._adapters.get(model)

    def endpoint_of(self, shard_id: str, url: str) -> EndpointRuntime | None:
        """The endpoint a load sample or KV batch names: by its serving shard, else by
        its URL (an engine not launched by the control plane's ids)."""
        ep = self.by_shard.get(shard_id)
        if ep is None and url:
            ep = self._by_url.get(url.rstrip("/"))
        return ep

    # ----------------------------------------------------------- reads for admin

    def models(self) -> list[tuple[str, str | None]]:
        """(name, canonical model or None for a model itself), models first."""
        out: list[tuple[str, str | None]] = [(m, None) for m in self._routes]
        out += [(n, m) for n, m in self._names.items() if n != m]
        return out

    def adapters(self) -> list[ModelRoute]:
        """The adapters' routes (each names its model in `adapter_of`)."""
        return list(self._adapters.values())

    def ready(self) -> bool:
        """Some model has an endpoint that is ready and not draining."""
        return any(
            ep.state is EndpointState.READY for r in self._routes.values() for ep in r.endpoints
        )

    # ----------------------------------------------------------- updates

    def on_load(self, listener: Callable[[EndpointRuntime], None]) -> None:
        """Call `listener(endpoint)` as each new load sample lands (admission reads it)."""
        self._load_listeners.append(listener)

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every change of the endpoint set."""
        self._listeners.append(listener)

    def replace(self, records: Iterable[ModelEndpoints]) -> list[str]:
        """Make these records the whole view (a snapshot); returns the problems skipped."""
        self._records = {}
        for rec in records:
            self._records.setdefault(rec.model, rec)
        return self._rebuild()

    def apply(self, record: ModelEndpoints) -> list[str]:
        self._records[record.model] = record
        return self._rebuild()

    def remove(self, model: str) -> list[str]:
        self._records.pop(model, None)
        return self._rebuild()

    def update_load(self, endpoint_id: str, load: Load | None, error: str | None = None) -> None:
        ep = self.endpoints.get(endpoint_id)
        if ep is None:
            return
        if load is not None:
            ep.load = load
            for listener in self._load_listeners:
                listener(ep)
        ep.scrape_error = error

    def _rebuild(self) -> list[str]:
        table, problems = routes.build(self._records.values())
        pipelines = self._pipelines(table.records, problems)
        records = {name: rec for name, rec in table.records.items() if name in pipelines}

        old_endpoints = self.endpoints
        endpoints: dict[str, EndpointRuntime] = {}
        served: dict[str, set[str]] = {}
        draining: set[str] = set()
        for rec in records.values():
            for spec in rec.endpoints:
                ep = endpoints.get(spec.id)
                if ep is None:
                    ep = old_endpoints.get(spec.id)
                    if ep is None or ep.url != spec.url.rstrip("/"):
                        ep = EndpointRuntime(spec, self.settings)
                    if ep.spec is not spec:  # a new record: the adapters a relay refuted
                        ep.adapters = frozenset(spec.adapters)  # (upstream.py) come back
                    ep.spec = spec
                    ep.headers = resolve_headers(spec.upstream)
                    endpoints[spec.id] = ep
                served.setdefault(spec.id, set()).add(rec.model)
                if spec.state is not EndpointState.READY:
                    draining.add(spec.id)
        for ep_id, ep in endpoints.items():
            ep.models = frozenset(served[ep_id])
            # An endpoint draining for one model drains for all: it is one engine.
            ep.state = EndpointState.DRAINING if ep_id in draining else EndpointState.READY

        new_routes: dict[str, ModelRoute] = {}
        for name, rec in records.items():
            seen: set[str] = set()
            eps = []
            for spec in rec.endpoints:
                if spec.id not in seen:
                    seen.add(spec.id)
                    eps.append(endpoints[spec.id])
            new_routes[name] = ModelRoute(
                name=name,
                endpoints=tuple(eps),
                pipeline=pipelines[name],
                deadlines=rec.deadlines,
                fallbacks=table.chains[name][1:],
                headers=resolve_headers(rec.upstream),
                api_kinds=frozenset(rec.api_kinds),
                record=rec,
                scale_from_zero=rec.scale_from_zero,
                unplaceable=rec.unplaceable,
                migrations=rec.migration.max,
            )
        self._adapters = self._adapter_routes(table, new_routes, problems)
        self.endpoints = endpoints
        self.by_shard = {projection.serving_shard(i): ep for i, ep in endpoints.items()}
        self._by_url = {ep.url: ep for ep in endpoints.values()}
        self._routes = new_routes
        self._names = table.names
        self._table = table
        self._judge_in(self.problems.report(problems, table.missing))
        self.version += 1
        for listener in self._listeners:
            listener()
        return problems

    def _adapter_routes(
        self, table: routes.RouteTable, models: dict[str, ModelRoute], problems: list[str]
    ) -> dict[str, ModelRoute]:
        """A route per adapter: its model's route narrowed to the endpoints holding it, run
        by the model's adapter pipeline (lora.adapter_spec); each holder serves it."""
        pipelines: dict[str, scheduling.Pipeline] = {}
        out: dict[str, ModelRoute] = {}
        for name, (model, adapter) in table.adapters.items():
            base = models.get(model)
            if base is None:
                continue
            pipeline = pipelines.get(model) or self._adapter_pipeline(base, problems)
            if pipeline is None:
                continue
            pipelines[model] = pipeline
            holders = tuple(ep for ep in base.endpoints if name in ep.adapters)
            for ep in holders:
                ep.models = ep.models | {name}
            ready = any(ep.state is EndpointState.READY for ep in base.endpoints)
            out[name] = replace(
                base,
                name=name,
                endpoints=holders,
                pipeline=pipeline,
                fallbacks=(),  # another model would answer as itself, not as the adapter
                scale_from_zero=True,  # no holder: wait while placement loads it somewhere
                # Only a model with no replica at all waits for one that cannot be placed.
                unplaceable="" if ready else base.unplaceable,
                adapter_of=model,
                tenants=frozenset(adapter.tenants),
            )
        self._adapter_pipelines = pipelines
        return out

    def _adapter_pipeline(
        self, base: ModelRoute, problems: list[str]
    ) -> scheduling.Pipeline | None:
        spec = lora.adapter_spec(base.pipeline.spec)
        # A disaggregated model's adapters go its two legs too: a prefill engine holding
        # the adapter must never answer a client.
        disaggregation = base.pipeline.disaggregation
        old = self._adapter_pipelines.get(base.name)
        if old is not None and old.spec == spec and old.disaggregation == disaggregation:
            return old
        try:
            return scheduling.Pipeline(
                spec,
                self.settings.scheduling,
                observer=self.observer,
                disaggregation=disaggregation,
            )
        except Exception as exc:  # as in _pipelines: its adapters fail alone
            problems.append(f"model {base.name!r}: adapters: cannot build their pipeline: {exc}")
            return None

    def _judge_in(self, delay: float | None) -> None:
        """Have the problem log judge its pending fallbacks in `delay` seconds. Without
        a running loop (a synchronous caller) they stay pending, logged at debug."""
        if self._judging is not None:
            self._judging.cancel()
            self._judging = None
        if delay is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._judging = loop.call_later(delay, lambda: self._judge_in(self.problems.judge()))

    def _pipelines(
        self, records: dict[str, ModelEndpoints], problems: list[str]
    ) -> dict[str, scheduling.Pipeline]:
        """Each model's pipeline: the one it has while its spec is unchanged (it keeps
        learned state such as session affinity), else a new one. A model whose pipeline
        cannot be built is left out, so one record never stops the others."""
        out = {}
        for name, rec in records.items():
            old = self._routes.get(name)
            if (
                old is not None
                and old.pipeline.spec == rec.scheduling
                and old.pipeline.disaggregation == rec.disaggregation
            ):
                out[name] = old.pipeline
                continue
            try:
                out[name] = scheduling.Pipeline(
                    rec.scheduling,
                    self.settings.scheduling,
                    observer=self.observer,
                    disaggregation=rec.disaggregation,
                )
            except Exception as exc:  # a plugin failing to start fails its own model only
                problems.append(f"model {name!r}: scheduling: cannot build its pipeline: {exc}")
        return out


class EndpointSource(Protocol):
    """Feeds an EndpointView and keeps it current until stopped."""

    async def start(self, view: EndpointView) -> None: ...

    async def stop(self) -> None: ...


class StaticSource:
    """Router-only mode: the records from the config file, applied once."""

    def __init__(self, records: list[ModelEndpoints]):
        self.records = records

    async def start(self, view: EndpointView) -> None:
        view.replace(self.records)

    async def stop(self) -> None:
        pass
