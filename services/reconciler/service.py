"""The reconciler process: compete for leadership; while leading, fold the log and act.

    start ──► schema at head? ──► NATS (provision) ──► admin listener
                                                      │
          ┌────────────── standby: try the lock every second ◄──────┐
          ▼                                                         │
        leader: load state from Postgres, take the next term and    │
        log TermStarted, recreate the durable consumer at stored    │
        seq + 1, start the actor (it acts once the fold reaches     │
        TermStarted), then fold                                     │
        batch after batch (commit, ack, tell the actor) until the   │
        lock's connection fails, the fold fails, or SIGTERM ────────┘

Every term starts from what Postgres holds, never from memory: the state a
previous term left in memory may be ahead of a transaction that failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as jsapi
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw import adminserver, bus, config, subjects, tlsconfig
from llmgw import contracts as c
from llmgw import tasks as llmgw_tasks
from llmgw.reconciler import leader
from llmgw.reconciler import metrics as m
from llmgw.reconciler.api import admin, auth
from llmgw.reconciler.config import ReconcilerConfig, resolve_id
from llmgw.reconciler.controllers.manager import Manager
from llmgw.reconciler.intake import consumer
from llmgw.reconciler.intake.batch import BatchResult, Folder
from llmgw.reconciler.state.model import ClusterState
from llmgw.reconciler.store import schema, store, streamid

log = logging.getLogger(__name__)

DURABLE = "llmgw-reconciler"


class Reconciler:
    def __init__(
        self,
        cfg: ReconcilerConfig,
        *,
        actor_factory: Callable[[], Manager] | None = None,
    ):
        self.cfg = cfg
        self.id = resolve_id(cfg)
        self.role = admin.Role(self.id)
        self.actor_factory = actor_factory or (lambda: Manager(cfg.actor))
        self.stop = asyncio.Event()
        self.state: ClusterState | None = None  # the live state while leading
        self.nc: NATS | None = None

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        logging.getLogger("alembic").setLevel(logging.WARNING)
        # A transaction left open by a leader cut off mid-commit holds the position row's
        # lock: the server ends it, so the next leader's first commit does not wait forever.
        idle = str(int(max(30.0, 3 * self.cfg.leader.session_timeout_seconds) * 1000))
        engine = schema.make_engine(
            self.cfg.database_url,
            connect_args={"server_settings": {"idle_in_transaction_session_timeout": idle}},
        )
        server: adminserver.AdminServer | None = None
        try:
            if not await self._wait_for_schema(engine):
                return 1
            if self.stop.is_set():
                return 0
            self.nc = await self._unless_stopped(
                bus.connect(
                    self.cfg.nats_url,
                    name=f"reconciler-{self.id}",
                    **tlsconfig.nats_options(self.cfg.nats_tls),
                )
            )
            if self.nc is None:
                return 0
            js = self.nc.jetstream()
            if not await self._provision(js):
                return 0
            host, port = config.host_port(self.cfg.admin_listen, 9300)
            authorizer = auth.Authorizer(self.cfg.api_auth, self.cfg.api_tokens)
            app = admin.build_app(engine, self.role, authorizer)
            server = adminserver.AdminServer(app, host, port, self.cfg.admin_tls)
            await server.start()
            log.info("reconciler %s up; admin on %s://%s:%d", self.id, server.scheme, host, port)
            if self.cfg.api_auth == auth.AUTH_TOKENS and not self.cfg.api_tokens:
                log.warning(
                    "no api_tokens: the operator API refuses every call; %s", auth.HOW_TO_CONFIGURE
                )
            await self._compete(engine, self.nc, js)
            return 0
        except (schema.SchemaError, adminserver.ListenError, config.ConfigError) as exc:
            log.error("%s", exc)
            return 1
        finally:
            self.role.name = "stopping"
            if server is not None:
                await server.stop()
            await bus.close_quietly(self.nc)
            await engine.dispose()
            log.info("reconciler %s stopped", self.id)

    async def _wait_for_schema(self, engine: AsyncEngine) -> bool:
        """True once the schema is at head; False (logged) if it is not; waits out a down DB."""
        warned = False
        while not self.stop.is_set():
            try:
                await schema.require_head(engine)
                return True
            except schema.SchemaError as exc:
                log.error("%s", exc)
                return False
            except (OSError, OperationalError, DBAPIError) as exc:
                if not warned:
                    log.warning("database not reachable (%s); waiting for it", exc)
                    warned = True
            await self._sleep(2.0)
        return True

    async def _unless_stopped(self, coro):
        """The coroutine's result, or None if SIGTERM came first (waits must not block it)."""
        task = asyncio.ensure_future(coro)
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return None

    async def _provision(self, js: JetStreamContext) -> bool:
        """Streams and buckets exist; retried while JetStream is not ready (a cluster forming)."""
        warned = False
        while not self.stop.is_set():
            try:
                await bus.provision(js, self.cfg.bus)
                return True
            except Exception as exc:
                if not warned:
                    log.warning("cannot provision NATS yet (%s); retrying", exc)
                    warned = True
            await self._sleep(2.0)
        return False

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), timeout=seconds)

    # ------------------------------------------------------------ leadership

    async def _compete(self, engine: AsyncEngine, nc: NATS, js: JetStreamContext) -> None:
        lcfg = self.cfg.leader
        dsn = schema.asyncpg_dsn(self.cfg.database_url)
        while not self.stop.is_set():
            self.role.name = "standby"
            lease = await leader.acquire(
                dsn,
                self.stop,
                lock_id=lcfg.lock_id,
                retry_interval=lcfg.retry_interval_seconds,
                check_interval=lcfg.check_interval_seconds,
                holder=self.id,
                session_timeout=lcfg.session_timeout_seconds,
            )
            if lease is None:
                return
            backoff = 1.0
            try:
                await self._lead(engine, nc, js, lease)
            except store.Fenced as exc:
                log.error("fenced: %s; stepping down", exc)
            except streamid.StreamMismatch as exc:
                log.error("%s", exc)
                self.role.problem = str(exc)
                backoff = 10.0
            except Exception:
                log.exception("leader term ended by an error; stepping down")
            finally:
                self.role.name = "standby"
                self.state = None
                await lease.release()
            if not self.stop.is_set():
                await self._sleep(backoff)

    async def _lead(
        self, engine: AsyncEngine, nc: NATS, js: JetStreamContext, lease: leader.Lease
    ) -> None:
        m.LEADER_TERMS.inc()
        begun = await self._while_held(lease, self._begin_term(engine, js))
        if begun is None:
            return
        state, stream_identity, psub, term, synced_seq = begun

        async def subscribe(start_seq: int):
            return await self._subscribe(js, start_seq, stream_identity)

        actor = self.actor_factory()
        folder = Folder(engine, state)
        tasks: list[asyncio.Task] = []
        fold: asyncio.Task | None = None
        try:
            await actor.start(nc, js, state, term=term, gate=folder.gate, synced_seq=synced_seq)
            fold = asyncio.create_task(self._fold_loop(psub, subscribe, folder, actor))
            lost = asyncio.create_task(lease.lost.wait())
            stopping = asyncio.create_task(self.stop.wait())
            tasks = [fold, lost, stopping]
            self.role.name = "leader"  # acting: the actor runs, the fold folds
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if lost.done():
                log.error("lost the leader lock's connection: stopped acting")
        finally:
            # Stop acting first, then make sure the fold has ended: a leader that lost its
            # lock must be done before Postgres frees the lock for another (a cancel can be
            # swallowed by a NATS request, and a commit on a frozen connection outlives
            # one, so it is repeated until the fold is gone).
            for task in tasks:
                task.cancel()
            try:
                await asyncio.wait_for(actor.stop(), timeout=15)
            except Exception:
                log.exception("actor did not stop cleanly")
            if await llmgw_tasks.cancel_until_done(tasks, timeout=15):
                log.error("the fold did not end within 15 s of stepping down")
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        if fold is not None and fold.done() and not fold.cancelled() and fold.exception():
            raise fold.exception()  # type: ignore[misc]

    async def _begin_term(self, engine: AsyncEngine, js: JetStreamContext):
        """The state from Postgres, the stream checked, the next term taken and announced,
        a fresh consumer at position + 1; and the seq the fold must reach before acting."""
        state = await store.load_state(engine)
        m.FOLDED_SEQ.set(state.last_seq)
        await bus.provision(js, self.cfg.bus)  # cheap when present; heals a deleted stream
        stream_identity = await streamid.check(engine, js, state.last_seq)
        self.role.problem = ""
        # Fencing: a term only this lock holder has. Its TermStarted event makes the fold
        # refuse every later control event of an older term (a predecessor's late write),
        # and marks how far the fold must get before this leader acts on anything
        # (controller-runtime's WaitForCacheSync: never decide on a half-read log).
        term = await store.next_term(engine, self.id)
        started = await bus.publish(
            js, c.TermStarted(term=term, leader=self.id, based_on_seq=state.last_seq)
        )
        log.info("leader term %d; acting once the fold reaches seq %d", term, started.seq)
        psub = await self._subscribe(js, state.last_seq + 1, stream_identity)
        self.state = state
        log.info("leading from seq %d", state.last_seq)
        return state, stream_identity, psub, term, started.seq

    async def _while_held(self, lease: leader.Lease, coro):
        """The coroutine's result; None if the lease is lost (or SIGTERM comes) first.

        Beginning a term goes through Postgres, and a frozen path there would hold it,
        unaware that the lock is gone, to go on leading once the path thaws. So it is
        cancelled when the lease goes, again and again until it has ended: a rollback
        on a dead connection outlives one cancel."""
        task = asyncio.ensure_future(coro)
        lost = asyncio.create_task(lease.lost.wait())
        stopping = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait({task, lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            stopping.cancel()
            if not task.done():
                if await llmgw_tasks.cancel_until_done([task], timeout=30):
                    log.error("beginning the term did not end within 30 s of stepping down")
        if lease.lost.is_set():
            log.error("lost the leader lock's connection while beginning the term")
        held = not (lease.lost.is_set() or self.stop.is_set())
        if task.cancelled() or (task.exception() is not None and not held):
            return None
        result = task.result()  # its error, if any
        if not held:
            with contextlib.suppress(Exception):
                await result[2].unsubscribe()
            return None
        return result

    async def _subscribe(self, js: JetStreamContext, start_seq: int, stream_identity: str):
        # Always afresh: what an old consumer delivered but never saw acknowledged
        # would come back after newer events, out of order.
        await streamid.still_the_same(js, stream_identity)
        return await bus.ensure_pull_consumer(
            js,
            subjects.EVENTS_STREAM,
            DURABLE,
            subjects.EVENTS_ALL,
            ack_wait=self.cfg.fold.ack_wait_seconds,
            max_ack_pending=max(10_000, 4 * self.cfg.fold.batch_size),
            ack_policy=jsapi.AckPolicy.ALL,
            start_seq=start_seq,
            recreate=True,
        )

    async def _fold_loop(
        self, psub, resubscribe: consumer.Resubscribe, folder: Folder, actor: Manager
    ) -> None:
        async def on_batch(result: BatchResult, pending: int) -> None:
            m.EVENTS_FOLDED.inc(result.folded)
            m.EVENTS_SKIPPED.inc(result.skipped)
            m.DEAD_LETTERS.inc(result.dead)
            m.NEVER_FOLDED.inc(result.never_folded)
            m.FOLDED_SEQ.set(result.last_seq)
            m.FOLD_LAG.set(pending)
            if result.folded or result.dead:
                await actor.on_state_changed(folder.state, result.changes)

        await consumer.consume(
            psub,
            folder,
            batch_size=self.cfg.fold.batch_size,
            fetch_wait=self.cfg.fold.fetch_wait_seconds,
            on_batch=on_batch,
            on_idle=lambda: m.FOLD_LAG.set(0),
            resubscribe=resubscribe,
        )
