"""The node agent: one process per GPU node, talking to the control plane only over NATS.

Tasks, all owned (started and cancelled) by `Agent.run`:
  publisher   ships shard status and registration in order, retrying until acknowledged
  heartbeats  one Heartbeat per interval on the node's subject
  commands    pulls StartShard / StopShard / DrainShard from the node's durable consumer
  load        scrapes engine /metrics several times a second, publishes LoadSample (core NATS)
  resync      after each reconnect: provision, re-register, re-bind the consumer
  one supervisor per engine (shard.py)
  admin-server /metrics, /healthz, /readyz (adminserver.py), up first and down last

Engines belong to the node, not to this process: on SIGTERM the agent stops consuming
commands and exits, leaving engines serving; the next agent re-adopts them.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import httpx
import zmq
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError, NotFoundError

from llmgw import __version__, adminserver, bus, config, subjects, tlsconfig
from llmgw import contracts as c
from llmgw.engines import ENGINES

from . import admin, launch, procs, validate
from .config import ADMIN_PORT, AgentConfig, parse_port_range
from .decide import Action, ShardView, answer_state, decide
from .inventory import Inventory
from .kvrelay import KvRelays
from .metrics import Load
from .shard import EngineShard, Timing
from .state import ShardRecord, StateDir
from .telemetry import COMMAND_KINDS, AgentMetrics, Live

log = logging.getLogger(__name__)

S = c.ShardState
FETCH_BATCH = 16
STREAM_NOT_FOUND = 10059  # JetStream API error code
AGENT_STREAMS = (subjects.EVENTS_STREAM, subjects.HEARTBEATS_STREAM, subjects.COMMANDS_STREAM)


def status_of(node: str, rec: ShardRecord, command_key: str | None = None) -> c.ShardStatus:
    return c.ShardStatus(
        node=node,
        shard_id=rec.shard_id,
        model=rec.model,
        replica_id=rec.replica_id,
        shard_index=rec.shard_index,
        state=rec.state,
        url=rec.url,
        port=rec.port,
        gpus=list(rec.gpus),
        command_key=rec.command_key if command_key is None else command_key,
        reason=rec.reason,
        exit_code=rec.exit_code,
        output_tail=list(rec.output_tail),
        max_running=rec.max_running,
    )


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Engines set SO_REUSEADDR too: a port in TIME_WAIT is free for them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def next_port(
    ports: Sequence[int], taken: set[int], last: int | None, is_free: Callable[[int], bool]
) -> int | None:
    """The first port of the range after `last` (wrapping) that no shard holds and is free.

    Going round the range instead of taking the lowest free port keeps a port that an
    engine just gave up from going at once to another model's engine: routers whose
    projection still lists the old endpoint would send its requests to the new one (404s)."""
    start = ports.index(last) + 1 if last in ports else 0
    for port in itertools.chain(ports[start:], ports[:start]):
        if port not in taken and is_free(port):
            return port
    return None


def held_ports(records: Iterable[ShardRecord]) -> set[int]:
    """Every port these shards' records hold: HTTP, KV relay and replay socket. An engine
    binds its ports only once its model is loaded (minutes), so until then only the
    record says they are spoken for."""
    return {p for rec in records for p in (rec.port, rec.kv_events_port, rec.kv_replay_port) if p}


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
        self.leader_term = 0  # the newest reconciler term a command came from
        self.ports = parse_port_range(cfg.engine_port_range)
        self._last_port: int | None = None  # the port handed out last (see next_port)
        self.bind_host = cfg.engine_bind_host or cfg.advertise_address
        self.probe_host = "127.0.0.1" if self.bind_host in ("0.0.0.0", "") else self.bind_host
        self.timing = Timing(
            ready_timeout=cfg.ready_timeout_seconds,
            ready_poll=cfg.ready_poll_seconds,
            headless_settle=cfg.headless_settle_seconds,
            drain_settle=cfg.drain_settle_seconds,
            tail_lines=cfg.output_tail_lines,
        )
        self.shards: dict[str, EngineShard] = {}
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.http: httpx.AsyncClient | None = None
        self.registered = asyncio.Event()  # set once the first registration is acknowledged
        self._outbox: collections.deque[c.Message] = collections.deque()
        self._outbox_ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._rebind = False
        self._hb_seq = 0
        self._tasks: set[asyncio.Task] = set()
        self._resync_task: asyncio.Task | None = None
        self._heartbeat_at: float | None = None  # monotonic time of the last acknowledged one
        self.metrics = AgentMetrics(self.live)
        self.kv_relays = KvRelays(node, metrics=self.metrics)

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
            self._spawn(self._publisher(), "publisher")
            await self.kv_relays.attach(self.nc)
            self._resync_task = self._spawn(self._resync(first=True), "resync")
            self._spawn(self._heartbeats(), "heartbeats")
            commands = self._spawn(self._commands(), "commands")
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
            outbox=len(self._outbox),
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
        while self._outbox and self.nc is not None and time.monotonic() < deadline:
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
            if rec.kv_events_port:
                self._reopen_relay(rec)
            self._supervise(shard)

    def _reopen_relay(self, rec: ShardRecord) -> None:
        """Bind the adopted engine's relay on its saved port: the engine's publisher
        reconnects to that port on its own. If another process took the port meanwhile,
        the shard is adopted without KV events (routers score it approximately)."""
        try:
            relay = self.kv_relays.open(
                rec.shard_id, rec.kv_events_port, rec.kv_replay_port, engine_running=True
            )
            relay.url = rec.url
        except zmq.ZMQError as exc:
            self.metrics.kv_relay_bind_failures.inc()
            log.warning(
                "shard %s: cannot rebind its KV event relay on port %d (%s); "
                "adopted without KV events",
                rec.shard_id,
                rec.kv_events_port,
                exc,
            )

    def _new_shard(self, rec: ShardRecord, proc: subprocess.Popen | None = None) -> EngineShard:
        shard = EngineShard(
            rec,
            state_dir=self.state_dir,
            timing=self.timing,
            emit=self._emit,
            http=self.http,
            probe_host=self.probe_host,
            count_exit=lambda reason: self.metrics.engine_exits.labels(reason).inc(),
            proc=proc,
        )
        self.shards[rec.shard_id] = shard
        return shard

    def _supervise(self, shard: EngineShard) -> None:
        shard.task = self._spawn(shard.supervise(), f"shard-{shard.rec.shard_id}")

    def live_shards(self) -> list[EngineShard]:
        return [s for s in self.shards.values() if not s.rec.terminal]

    # ------------------------------------------------------------ publishing

    def _emit(self, rec: ShardRecord) -> None:
        self._enqueue(status_of(self.node, rec))
        if rec.terminal and rec.shard_id in self.kv_relays.relays:
            self._spawn(self.kv_relays.close(rec.shard_id), f"kv-relay-close-{rec.shard_id}")

    def _enqueue(self, msg: c.Message) -> None:
        self._outbox.append(msg)
        self._outbox_ready.set()

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

    async def _publisher(self) -> None:
        """Publish the outbox in order; a message leaves it only once JetStream stored it."""
        delay = 0.1
        while True:
            if not self._outbox:
                self._outbox_ready.clear()
                await self._outbox_ready.wait()
                continue
            msg = self._outbox[0]
            try:
                await bus.publish(self.js, msg, deadline=5.0)
            except Exception as exc:  # disconnected, stream missing...: keep it and retry
                log.warning("publishing %s failed (%s); retrying", type(msg).__name__, exc)
                what = "registration" if isinstance(msg, c.NodeRegistered) else "status"
                self.metrics.publish_failures.labels(what).inc()
                if isinstance(exc, NoStreamResponseError):
                    await self._ensure_streams()
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.1
            self._outbox.popleft()
            if isinstance(msg, c.NodeRegistered):
                self.registered.set()

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
        self._enqueue(self.registration())
        if not first:
            self._rebind = True
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
        )
        try:
            # Core NATS, fire and forget: a lost sample is replaced a fraction of a second later.
            await self.nc.publish(subjects.load(self.node), c.encode(sample))
        except Exception as exc:
            log.debug("load sample not published: %s", exc)
            self.metrics.publish_failures.labels("load_sample").inc()
        else:
            self.metrics.load_samples.inc()

    # ------------------------------------------------------------ commands

    async def _commands(self) -> None:
        sub = None
        delay = 0.2
        while True:
            try:
                if sub is None or self._rebind:
                    self._rebind = False
                    sub = await bus.ensure_pull_consumer(
                        self.js,
                        subjects.COMMANDS_STREAM,
                        durable=f"agent-{self.node}",
                        filter_subject=subjects.commands(self.node),
                    )
                msgs = await sub.fetch(FETCH_BATCH, timeout=1.0)
            except TimeoutError:
                continue  # nothing to do
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("command consumer failed (%s); re-binding", exc)
                if isinstance(exc, NotFoundError) and exc.err_code == STREAM_NOT_FOUND:
                    await self._ensure_streams()
                sub = None
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.2
            for msg in msgs:
                try:
                    await self._on_command_msg(msg)
                except Exception as exc:  # an ack lost to a disconnect: the command comes again
                    log.warning("command acknowledgement failed: %s", exc)

    async def _on_command_msg(self, msg) -> None:
        try:
            cmd = c.decode(msg.data, c.Command)
        except c.ContractError as exc:
            # Dead letter: logged with its payload and terminated, never redelivered.
            log.error("dead letter on %s: %s; payload %r", msg.subject, exc.reason, msg.data[:500])
            self.metrics.commands_received.labels("unknown").inc()
            self.metrics.commands_rejected.labels("unknown", "malformed").inc()
            await msg.term()
            return
        self.metrics.commands_received.labels(COMMAND_KINDS[type(cmd)]).inc()
        try:
            self.handle(cmd)
        except Exception:
            log.exception("command %s (%s) could not be handled", cmd.key, type(cmd).__name__)
            self.metrics.commands_rejected.labels(COMMAND_KINDS[type(cmd)], "error").inc()
            await msg.term()
            return
        await msg.ack()

    def handle(self, cmd: c.StartShard | c.StopShard | c.DrainShard) -> None:
        """Apply one command; every command is answered with a shard status."""
        kind = COMMAND_KINDS[type(cmd)]
        if cmd.node != self.node:
            log.error("command %s is for node %s, not %s: ignored", cmd.key, cmd.node, self.node)
            self.metrics.commands_rejected.labels(kind, "wrong_node").inc()
            return
        stale = self._stale(cmd)
        if stale is not None:
            self.metrics.commands_rejected.labels(kind, stale).inc()
            return
        shard = self.shards.get(cmd.shard_id)
        view = None
        if shard is not None:
            view = ShardView(shard.rec.state, frozenset(shard.rec.keys), shard.rec.stopping)
        action = decide(cmd, view)
        log.info(
            "command %s %s for shard %s: %s",
            type(cmd).__name__,
            cmd.key,
            cmd.shard_id,
            action.value,
        )
        if action is Action.LAUNCH:
            rejected = self._launch(cmd, shard)
            if rejected is not None:
                self.metrics.commands_rejected.labels(kind, rejected).inc()
                return
        elif action is Action.STOP:
            # Answered by the `stopped` status once the engine is gone.
            shard.request_stop(cmd.key, cmd.grace_seconds if isinstance(cmd, c.StopShard) else 10.0)
        elif action is Action.DRAIN:
            shard.request_drain(cmd.key, cmd.deadline_seconds)
        elif shard is None:
            self._enqueue(
                c.ShardStatus(
                    node=self.node,
                    shard_id=cmd.shard_id,
                    model="",
                    replica_id="",
                    state=answer_state(None),
                    command_key=cmd.key,
                    reason="no such shard on this node",
                )
            )
        else:
            shard.note_command(cmd.key)
            self._enqueue(status_of(self.node, shard.rec, cmd.key))
        self.metrics.commands_applied.labels(kind, action.value).inc()

    def _stale(self, cmd: c.StartShard | c.StopShard | c.DrainShard) -> str | None:
        """Why a command is dropped unanswered: meant for an earlier boot of this node
        (a consumer replaying old commands), or sent by a leader older than one already
        heard from (a deposed leader's late write). The current leader re-sends what it
        still wants under its own term and this boot."""
        if cmd.boot_id and cmd.boot_id != self.boot_id:
            log.warning(
                "command %s is for boot %s of this node, this is boot %s: dropped",
                cmd.key,
                cmd.boot_id,
                self.boot_id,
            )
            return "stale_boot"
        if cmd.term < self.leader_term:
            log.warning(
                "command %s is from leader term %d, term %d already spoke: dropped",
                cmd.key,
                cmd.term,
                self.leader_term,
            )
            return "stale_term"
        self.leader_term = cmd.term
        return None

    # ------------------------------------------------------------ launching

    def _facts(self) -> validate.NodeFacts:
        holders = {gpu: s.rec.shard_id for s in self.live_shards() for gpu in s.rec.gpus}
        probe = self.inventory.probe
        return validate.NodeFacts(
            node=self.node,
            gpus=self.inventory.gpus,
            gpu_holders=holders,
            free_memory=probe.free_memory if probe else (lambda uuid: None),
            process_count=probe.process_count if probe else (lambda uuid: None),
            engine_missing=lambda engine: self.engines.get(engine),
            path_exists=lambda path: Path(path).expanduser().exists(),
        )

    def _free_port(self) -> int | None:
        taken = held_ports(s.rec for s in self.live_shards())
        http = [s.rec.port for s in self.live_shards() if s.rec.port in self.ports]
        if self._last_port is None and http:
            self._last_port = max(http)  # adopted engines: go on after the newest
        port = next_port(
            self.ports, taken, self._last_port, lambda p: port_is_free(self.bind_host, p)
        )
        if port is not None:
            self._last_port = port
        return port

    def _launch(self, cmd: c.StartShard, previous: EngineShard | None) -> str | None:
        """Launch the engine; None, or why not (a reason label: the shard is `failed`)."""
        keys = list(previous.rec.keys) if previous else []
        rec = ShardRecord(
            shard_id=cmd.shard_id,
            model=cmd.model,
            replica_id=cmd.replica_id,
            shard_index=cmd.shard_index,
            engine=cmd.profile.engine,
            command_key=cmd.key,
            keys=[*keys, cmd.key],
            start=cmd,
            gpus=list(cmd.gpus),
            max_running=cmd.profile.max_num_seqs,
            log_path=str(self.state_dir.log_path(cmd.shard_id)),
        )
        refusal = validate.check(cmd, self._facts())  # before this shard counts as holding GPUs
        shard = self._new_shard(rec)
        if refusal is not None:
            self.metrics.validation_refusals.labels(refusal.check).inc()
            shard.transition(S.FAILED, reason=str(refusal))
            return "invalid"
        adapter = launch.ADAPTERS.get(cmd.profile.engine)
        port = 0
        if adapter.serves_http(cmd):
            port = self._free_port() or 0
            if not port:
                reason = f"no free port in the engine port range {self.cfg.engine_port_range}"
                shard.transition(S.FAILED, reason=reason)
                return "no_free_port"
        relay = None
        kv_events = self.cfg.kv_events and ENGINES[cmd.profile.engine].kv_events
        off = launch.kv_events_off_reason(cmd.profile) if kv_events and port else ""
        if off:
            kv_events = False
            log.warning(
                "shard %s: %s KV events are off, routers use the approximate prefix scorer "
                "for it: %s",
                cmd.shard_id,
                cmd.profile.engine,
                off,
            )
        if kv_events and port:
            try:
                replay_port = self.kv_relays.replay_port(
                    avoid=[self.ports], taken=held_ports(s.rec for s in self.live_shards()) | {port}
                )
            except OSError as exc:
                log.warning("shard %s: KV events without replay: %s", cmd.shard_id, exc)
                replay_port = 0
            relay = self.kv_relays.open(cmd.shard_id, replay_port=replay_port)
        spec = adapter.build(
            cmd,
            launch.LaunchContext(
                port=port,
                gpu_indices=[self.inventory.gpus[g].index for g in cmd.gpus],
                bind_host=self.bind_host,
                command=self._engine_command(cmd.profile.engine),
                kv_events_endpoint=relay.endpoint if relay else "",
                kv_replay_endpoint=relay.replay_endpoint if relay else "",
            ),
        )
        rec.port = spec.port
        rec.advertised = spec.advertised
        rec.url = (
            f"http://{self.cfg.advertise_address}:{spec.port}"
            if spec.advertised and spec.port
            else ""
        )
        if relay is not None:
            relay.url = rec.url
            rec.kv_events_port = relay.port
            rec.kv_replay_port = relay.replay_port
        rec.argv = spec.argv
        rec.launched_at = time.time()
        shard.transition(S.LAUNCHING)
        try:
            with open(rec.log_path, "wb") as out:
                proc = subprocess.Popen(
                    spec.argv,
                    env=launch.engine_environment(os.environ, spec),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    # Its own session: signals to the agent's process group (a Ctrl-C, a
                    # service manager stopping the agent) do not reach the engine.
                    start_new_session=True,
                    cwd=self.state_dir.root,
                )
        except OSError as exc:
            shard.transition(S.FAILED, reason=f"cannot start {spec.argv[0]}: {exc.strerror or exc}")
            return "spawn_error"
        shard.proc = proc
        rec.pid = proc.pid
        rec.proc_start = procs.process_start(proc.pid)
        rec.kernel_boot_id = procs.kernel_boot_id()
        shard.transition(S.LOADING)
        self._supervise(shard)
        return None

    def _engine_command(self, engine: str) -> list[str]:
        return self.cfg.engine_commands()[engine]
