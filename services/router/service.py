"""Assembles one router process: view, source, scraper, proxy, and the public app.

The source is the config file (router-only mode) or, with `nats_url`, the
control plane (controlplane/), which also feeds admission its tenants, bands
and the live router count.

`RouterService` owns every long-lived piece and starts and stops them in
order. `worker_app` is the factory uvicorn imports in each worker process when
the router runs with several workers (uvicorn needs an import string then);
the parent hands the resolved config over in an environment variable, so
every worker runs exactly what the parent validated.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from llmgw import logs
from llmgw.router.admission.gate import control_plane_gate, from_router_config
from llmgw.router.config import RouterConfig, projection, resolve_router_id
from llmgw.router.endpoints.capacity import BatchCapacities
from llmgw.router.endpoints.scraper import Scraper
from llmgw.router.endpoints.view import EndpointSource, EndpointView, StaticSource, ViewSettings
from llmgw.router.http import snapshots
from llmgw.router.http.app import HotPaths, public_app
from llmgw.router.http.models import EngineModels
from llmgw.router.kvcache.index import BlockIndex
from llmgw.router.kvcache.indexer import Indexer
from llmgw.router.metrics import RouterMetrics
from llmgw.router.request import handler as px
from llmgw.router.scheduling import pipeline as scheduling

if TYPE_CHECKING:
    from llmgw.router.admission.seam import Gate

CONFIG_ENV = "LLMGW_ROUTER_RESOLVED_CONFIG"
SNAPSHOT_ENV = "LLMGW_ROUTER_SNAPSHOT_DIR"


class RouterService:
    def __init__(
        self,
        config: RouterConfig,
        *,
        source: EndpointSource | None = None,
        gate: Gate | None = None,
    ):
        if config.nats_url:
            config = resolve_router_id(config)
        self.config = config
        self.metrics = RouterMetrics()
        # Each engine's batch size, learned once from its load samples and read by both
        # admission's saturation detector and the kv_prefix scorer's affinity limit.
        self.batches = BatchCapacities(
            stale_after=config.scrape.stale_after_seconds,
            relearn_after=config.admission.capacity_relearn_seconds,
        )
        # Engines' KV events arrive over the bus, so only with a control plane: the
        # control-plane source feeds this index, the kv_prefix scorers read it.
        self.kv_index = BlockIndex(config.prefix.index_max_blocks) if config.nats_url else None
        self.view = EndpointView(
            ViewSettings(
                circuit_failures=config.circuit.failures,
                circuit_cooldown=config.circuit.cooldown_seconds,
                scheduling=scheduling.Settings(
                    stale_after=config.scrape.stale_after_seconds,
                    indexer=Indexer(self.kv_index) if self.kv_index is not None else None,
                    prefix=config.prefix,
                    batches=self.batches,
                ),
            ),
            observer=self.metrics,
        )
        # Registered first: admission, told of the same sample next, reads what it taught.
        self.view.on_load(self.batches.observed)
        self.view.subscribe(lambda: self.batches.keep_only(self.view.endpoints))
        self.admission = None
        if source is None and config.nats_url:
            # Tenants and bands arrive later: the gate always exists, and the proxy uses
            # it only while it has something to do (_install_gate).
            from llmgw.router.controlplane.source import ControlPlaneSource

            self.admission = control_plane_gate(config, self.metrics.admission, self.batches)
            source = ControlPlaneSource(
                config,
                self.admission,
                self.metrics,
                kv_index=self.kv_index,
                on_gate_change=self._install_gate,
            )
        elif gate is None:
            gate = self.admission = from_router_config(config, self.metrics.admission, self.batches)
        self.source = source or StaticSource(projection(config))
        if self.admission is not None:
            self.admission.route_of = self.view.route
            self.view.on_load(self.admission.observed)
            self.view.subscribe(self._endpoints_changed)
        self.proxy = px.Proxy(
            self.view,
            self.metrics,
            px.Settings(
                max_body_bytes=config.max_body_bytes,
                body_read_seconds=config.body_read_timeout_seconds,
                attempts_per_model=config.retry.attempts_per_model,
                pool_limit=config.upstream.pool_limit,
                keepalive_seconds=config.upstream.keepalive_seconds,
                access_log=config.access_log,
            ),
            gate,
        )
        self._install_gate()
        self.scraper = (
            Scraper(
                self.view,
                self.metrics,
                config.scrape,
                fallback_only=bool(config.nats_url) and config.scrape.fallback_only,
            )
            if config.scrape.enabled
            else None
        )
        self.started = False
        self._writer: snapshots.Writer | None = None
        self.engine_models = EngineModels()

    async def start(self, snapshot_dir: Path | None = None) -> None:
        await self.proxy.start()
        await self.source.start(self.view)
        if self.scraper is not None:
            await self.scraper.start()
        self.started = True
        if snapshot_dir is not None:
            self._writer = snapshots.Writer(snapshot_dir, self.snapshot)
            self._writer.start()

    async def stop(self) -> None:
        self.started = False
        if self._writer is not None:
            await self._writer.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        await self.source.stop()
        await self.proxy.stop()
        if self.admission is not None:
            self.admission.close()

    def _endpoints_changed(self) -> None:
        def endpoints_of(model: str):
            route = self.view.route(model)
            return route.endpoints if route is not None else ()

        self.admission.endpoints_changed(endpoints_of)
        # A LoRA adapter's requests wait while no replica holds it: the same wait.
        cold = bool(self.view.adapters()) or any(
            r.scale_from_zero for m, _ in self.view.models() if (r := self.view.route(m))
        )
        if cold != self.admission.scale_from_zero:
            self.admission.routes_changed(cold)
            self._install_gate()

    def _install_gate(self) -> None:
        """Control-plane mode: admission in the request path only while it can act."""
        if self.config.nats_url and self.admission is not None:
            self.proxy.set_gate(self.admission if self.admission.active else None)

    def readiness(self) -> tuple[bool, str]:
        if not self.started:
            return False, "starting"
        if not self.view.ready():
            return False, "no ready endpoint known"
        return True, "ok"

    def describe_endpoints(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        stale = self.config.scrape.stale_after_seconds
        out = [ep.describe(now, stale) for ep in self.view.endpoints.values()]
        index = self.kv_index
        if index is not None:
            for ep in out:
                st = index.endpoints.get(ep["id"])
                # Blocks the engine holds per its KV events; null: no events (approximate).
                ep["kv_events_blocks"] = st.count if st is not None and st.synced else None
        return out

    def snapshot(self) -> snapshots.Snapshot:
        self.metrics.refresh_endpoints(self.view.endpoints.values(), time.monotonic())
        return snapshots.Snapshot(
            pid=os.getpid(),
            written_at=time.time(),
            ready=self.readiness()[0],
            metrics=self.metrics.registry.snapshot(),
            endpoints=self.describe_endpoints(),
        )


def encode_config(config: RouterConfig) -> str:
    return msgspec.json.encode(config).decode()


def worker_app() -> HotPaths:
    """The factory each worker process calls (`--workers N`)."""
    config = msgspec.json.decode(os.environ[CONFIG_ENV].encode(), type=RouterConfig)
    logs.setup("router", config.log_level)
    snapshot_dir = os.environ.get(SNAPSHOT_ENV)
    service = RouterService(config)
    return public_app(
        service, snapshot_dir=Path(snapshot_dir) if snapshot_dir else None, tune_gc=True
    )
