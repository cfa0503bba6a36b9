"""The node agent: one process per GPU node, talking to the control plane only over NATS.

`Agent` holds the node's shards and wires its collaborators: the outbox (outbox.py),
the command handler (commands.py) and the launcher (launcher.py). Tasks, all owned
(started and cancelled) by `Agent.run`:
  publisher   ships shard status and registration in order, retrying until acknowledged
              (Outbox.publish)
  heartbeats  one Heartbeat per interval on the node's subject
  commands    pulls StartShard / StopShard / DrainShard / SetShardAdapters from the node's
              durable consumer (Commands.consume)
  load        scrapes engine /metrics several times a second, publishes LoadSample (core NATS)
  resync      after each reconnect: provision, re-register, re-bind the consumer
  one supervisor per engine (shard.py), and under it one adapter sync per engine with
              LoRA slots (lora.py)
  admin-server /metrics, /healthz, /readyz (adminserver.py), up first and down last

Engines belong to the node, not to this process: on SIGTERM the agent stops consuming
commands and exits, leaving engines serving; the next agent re-adopts them.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time

import httpx
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from llmgw import __version__, adminserver, bus, config, subjects, tlsconfig
from llmgw import contracts as c

from . import admin, kvsockets, procs
from .commands import Commands
from .config import ADMIN_PORT, AgentConfig
from .inventory import Inventory
from .kvrelay import KvRelays
from .launcher import Launcher
from .lora import Retry
from .metrics import Load
from .outbox import Outbox
from .shard import EngineShard, Timing
from .state import ShardRecord, StateDir
from .telemetry import AgentMetrics, Live

log = logging.getLogger(__name__)

S = c.ShardState
AGENT_STREAMS = (subjects.EVENTS_STREAM, subjects.HEARTBEATS_STREAM, subjects.COMMANDS_STREAM)


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        node: str,
        inventory: Inventory,
        state_dir: StateDir,
        engines: dict[str, str | None],
    ):
        self.cfg = cfg
        self.node = node
        self.inventory = inventory
        self.state_dir = state_dir
        self.engines = engines  # name -> None if installed, else why not
        self.boot_id = c.new_id()  # changes on every agent process start
        self.timing = Timing(
            ready_timeout=cfg.ready_timeout_seconds,
            ready_poll=cfg.ready_poll_seconds,
            headless_settle=cfg.headless_settle_seconds,
            drain_settle=cfg.drain_settle_seconds,
            tail_lines=cfg.output_tail_lines,
            adapter_retry=Retry(
                attempts=cfg.adapter_attempts,
                first_backoff=cfg.adapter_backoff_seconds,
                call_timeout=cfg.adapter_call_timeout_seconds,
            ),
        )
        self.shards: dict[str, EngineShard] = {}
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.http: httpx.AsyncClient | None = None
        self.registered = asyncio.Event()  # set once the first registration is acknowledged
        self._stop = asyncio.Event()
        self._hb_seq = 0
        self._tasks: set[asyncio.Task] = set()
        self._resync_task: asyncio.Task | None = None
        self._heartbeat_at: float | None = None  # monotonic time of the last acknowledged one
        self.metrics = AgentMetrics(self.live)
        self.kv_relays = KvRelays(node, state_dir.kv_sockets, metrics=self.metrics)
        self.outbox = Outbox(node, self.metrics, self.registered, self._ensure_streams)
        self.launcher = Launcher(
            cfg,
            node,
            inventory,
            state_dir,
            engines,
            self.kv_relays,
            self.metrics,
            new_shard=self._new_shard,
            supervise=self._supervise,
            live_shards=self.live_shards,
        )
        bind_host = self.launcher.bind_host
        self.probe_host = "127.0.0.1" if bind_host in ("0.0.0.0", "") else bind_host
        self.commands = Commands(
            node,
            self.boot_id,
            self.shards,
            self.launcher,
            self.outbox,
            self.metrics,
            self._ensure_streams,
        )

    # ------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Ask `run` to return (SIGTERM): stop consuming, leave engines running."""
        self._stop.set()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self) -> None:
        self.http = httpx.AsyncClient(trust_env=False)
        server: adminserver.AdminServer | None = None
        try:
            # Before adopting: a failed start must not swallow the news of engines that died.
            server = await self._start_admin()
            self._adopt()
            connect = asyncio.create_task(
                bus.connect(
                    self.cfg.nats,
                    name=f"agent-{self.node}",
                    on_reconnect=self._on_reconnect,
                    on_disconnect=self._on_disconnect,
                    **tlsconfig.nats_options(self.cfg.nats_tls),
                )
            )
            stop_wait = asyncio.create_task(self._stop.wait())
            await asyncio.wait({connect, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            if not connect.done():
                connect.cancel()
                await asyncio.gather(connect, return_exceptions=True)
                return
            self.nc = connect.result()
            self.js = self.nc.jetstream()
            log.info("connected to NATS as node %s (boot %s)", self.node, self.boot_id)
            self._spawn(self.outbox.publish(self.js), "publisher")
            await self.kv_relays.attach(self.nc)
            self._resync_task = self._spawn(self._resync(first=True), "resync")
            self._spawn(self._heartbeats(), "heartbeats")
            commands = self._spawn(self.commands.consume(self.js), "commands")
            self._spawn(self._load_samples(), "load")
            await self._stop.wait()
            commands.cancel()  # stop consuming first: no command half-handled at exit
            await asyncio.gather(commands, return_exceptions=True)
        finally:
            await self._shutdown()
            if server is not None:
                await server.stop()

    async def _start_admin(self) -> adminserver.AdminServer | None:
        if not self.cfg.admin_listen:
            return None
        host, port = config.host_port(self.cfg.admin_listen, ADMIN_PORT)
        server = adminserver.AdminServer(
            admin.build_app(self.metrics.text, self.readiness), host, port
        )
        await server.start()
        log.info("admin listener on http://%s:%d (/metrics, /healthz, /readyz)", host, server.port)
        return server

    def live(self) -> Live:
        at = self._heartbeat_at
        return Live(
            node=self.node,
            version=__version__,
            shards=[(s.rec.model, s.rec.state) for s in self.shards.values()],
            nats_connected=self.nc is not None and self.nc.is_connected,
            registered=self.registered.is_set(),
            outbox=len(self.outbox),
            heartbeat_age=None if at is None else time.monotonic() - at,
            gpus=self.inventory.gpus,
            host=self.inventory.host,
        )

    def readiness(self) -> tuple[bool, str]:
        if self.nc is None or not self.nc.is_connected:
            return False, "not connected to NATS"
        if not self.registered.is_set():
            return False, "connected to NATS; registration not yet acknowledged"
        return True, "connected to NATS and registered"

    async def _shutdown(self) -> None:
        running = [s for s in self.shards.values() if s.task and not s.task.done()]
        background = [t for t in self._tasks if t.get_name() != "publisher"]
        for task in background + [s.task for s in running]:
            task.cancel()
        await asyncio.gather(*background, *(s.task for s in running), return_exceptions=True)
        if running:
            log.info(
                "exiting; %d engine(s) keep running and will be re-adopted: %s",
                len(running),
                ", ".join(s.rec.shard_id for s in running),
            )
        # Give queued shard status a moment to reach the control plane.
        deadline = time.monotonic() + 3.0
        while len(self.outbox) and self.nc is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.kv_relays.stop()
        await self._close_nats()
        if self.http is not None:
            await self.http.aclose()

    async def _close_nats(self) -> None:
        # Not drain(): draining waits on the cancelled pull subscription's queue for its full
        # timeout. Everything worth sending was published and acknowledged already.
        if self.nc is None or self.nc.is_closed:
            return
        try:
            await self.nc.flush(timeout=1)
        except Exception as exc:
            log.debug("flush before close failed: %s", exc)
        await self.nc.close()

    # ------------------------------------------------------------ adoption

    def _adopt(self) -> None:
        """Take back the engines an earlier agent process launched (state dir)."""
        records = self.state_dir.load_all()
        for rec in self.state_dir.prune(records):
            records.remove(rec)
        loopback_kv = self.state_dir.loopback_kv_ports()
        for rec in records:
            shard = self._new_shard(rec)
            if rec.terminal:
                continue
            alive = rec.pid is not None and procs.is_alive(
                rec.pid, rec.proc_start, rec.kernel_boot_id
            )
            if not alive:
                shard.fail(
                    None, "the engine exited while the agent was not running", "died_unsupervised"
                )
                continue
            log.info("re-adopted shard %s (pid %s, %s)", rec.shard_id, rec.pid, rec.state.value)
            if rec.shard_id in loopback_kv:
                events_port, replay_port = loopback_kv[rec.shard_id]
                log.warning(
                    "shard %s was launched by an older agent with its KV event sockets on "
                    "loopback TCP (events 127.0.0.1:%s, replay 127.0.0.1:%s): any local user "
                    "can reach them, and no KV events are relayed for it; drain and relaunch "
                    "it (docs/agent.md, 'Agent restarts', says how)",
                    rec.shard_id,
                    events_port,
                    replay_port,
                )
            if rec.kv_events_endpoint:
                # The engine's sockets stay where it bound them; the relay connects.
                relay = self.kv_relays.open(
                    rec.shard_id,
                    (rec.kv_events_endpoint, rec.kv_replay_endpoint),
                    engine_running=True,
                )
                relay.url = rec.url
            self._supervise(shard)
        # No engine is being launched yet: socket files no live engine holds are of
        # engines killed without closing them (a bind would replace them anyway).
        kvsockets.prune(
            self.state_dir.kv_sockets,
            {
                e
                for s in self.live_shards()
                for e in (s.rec.kv_events_endpoint, s.rec.kv_replay_endpoint)
            },
        )

    def _new_shard(self, rec: ShardRecord, proc: subprocess.Popen | None = None) -> EngineShard:
        shard = EngineShard(
            rec,
            state_dir=self.state_dir,
            timing=self.timing,
            emit=self._shard_changed,
            http=self.http,
            probe_host=self.probe_host,
            count_exit=lambda reason: self.metrics.engine_exits.labels(reason).inc(),
            count_adapter_op=lambda op, outcome: self.metrics.adapter_ops.labels(op, outcome).inc(),
            proc=proc,
        )
        self.shards[rec.shard_id] = shard
        return shard

    def _supervise(self, shard: EngineShard) -> None:
        shard.task = self._spawn(shard.supervise(), f"shard-{shard.rec.shard_id}")

    def live_shards(self) -> list[EngineShard]:
        return [s for s in self.shards.values() if not s.rec.terminal]

    # ------------------------------------------------------------ publishing

    def _shard_changed(self, rec: ShardRecord) -> None:
        """A shard's record changed: publish its status; a finished shard's relay goes."""
        self.outbox.emit(rec)
        if rec.terminal and rec.shard_id in self.kv_relays.relays:
            self._spawn(self.kv_relays.close(rec.shard_id), f"kv-relay-close-{rec.shard_id}")

    def registration(self) -> c.NodeRegistered:
        return c.NodeRegistered(
            node=self.node,
            agent_version=__version__,
            gpus=dict(self.inventory.gpus),
            host=self.inventory.host,
            labels=dict(self.cfg.labels),
            engines=sorted(name for name, why in self.engines.items() if why is None),
            shards=[s.rec.info() for s in self.live_shards()],
            boot_id=self.boot_id,
        )

    async def _on_disconnect(self) -> None:
        self.registered.clear()

    async def _on_reconnect(self) -> None:
        self.metrics.reconnects.inc()
        if self._resync_task is not None:
            self._resync_task.cancel()
        self._resync_task = self._spawn(self._resync(first=False), "resync")

    async def _resync(self, first: bool) -> None:
        """Make sure streams exist, then tell the control plane the whole truth again."""
        await self._ensure_streams()
        self.outbox.enqueue(self.registration())
        if not first:
            self.commands.rebind()
            log.info("reconnected: re-registering with %d shard(s)", len(self.live_shards()))

    async def _ensure_streams(self) -> None:
        """Provision only when one of the agent's streams is missing (a NATS that lost its
        storage, or an agent started first on a fresh one).

        Looking first matters under mTLS: an agent may look its streams up but not create
        streams or buckets, and a denied request surfaces only as a timeout. Failures are
        logged; the publisher and the consumer retry on their own.
        """
        try:
            missing = [name for name in AGENT_STREAMS if not await self._stream_exists(name)]
            if missing:
                log.warning("streams %s missing: provisioning", ", ".join(missing))
                await bus.provision(self.js, self.cfg.bus)
        except Exception as exc:
            log.warning("checking or provisioning streams failed: %s", exc)

    async def _stream_exists(self, name: str) -> bool:
        try:
            await self.js.stream_info(name)
        except NotFoundError:
            return False
        return True

    async def _heartbeats(self) -> None:
        interval = self.cfg.heartbeat_interval_seconds
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            self._hb_seq += 1
            hb = c.Heartbeat(
                node=self.node,
                boot_id=self.boot_id,
                seq=self._hb_seq,
                shards={s.rec.shard_id: s.rec.state for s in self.live_shards()},
            )
            try:
                await bus.publish(self.js, hb, deadline=interval)
            except Exception as exc:
                log.debug("heartbeat %d not published: %s", hb.seq, exc)
                self.metrics.publish_failures.labels("heartbeat").inc()
            else:
                self._heartbeat_at = time.monotonic()
                self.metrics.heartbeats.inc()
            next_at += interval  # a fixed rate, not interval-plus-publish-time
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            if loop.time() - next_at > interval:
                next_at = loop.time()  # after a long stall, don't burst to catch up

    async def _load_samples(self) -> None:
        interval = self.cfg.load_interval_seconds
        while True:
            started = time.monotonic()
            shards = [
                s
                for s in self.shards.values()
                if s.rec.state in (S.READY, S.DRAINING) and s.rec.advertised and s.rec.port
            ]
            if shards:
                loads = await asyncio.gather(
                    *(s.scrape(timeout=max(interval, 0.5)) for s in shards)
                )
                for shard, load in zip(shards, loads, strict=True):
                    if load is not None:
                        await self._publish_load(shard, load)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _publish_load(self, shard: EngineShard, load: Load) -> None:
        sample = c.LoadSample(
            node=self.node,
            shard_id=shard.rec.shard_id,
            model=shard.rec.model,
            url=shard.rec.url,
            waiting=load.waiting,
            running=load.running,
            kv_usage=load.kv_usage,
            block_size=load.block_size,
            num_blocks=load.num_blocks,
            running_adapters=list(load.running_adapters),
            waiting_adapters=list(load.waiting_adapters),
        )
        try:
            # Core NATS, fire and forget: a lost sample is replaced a fraction of a second later.
            await self.nc.publish(subjects.load(self.node), c.encode(sample))
        except Exception as exc:
            log.debug("load sample not published: %s", exc)
            self.metrics.publish_failures.labels("load_sample").inc()
        else:
            self.metrics.load_samples.inc()
