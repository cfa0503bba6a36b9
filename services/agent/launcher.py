"""Starting one engine for a StartShard: the steps between a command and a process.

A launch refuses early (validation, no free port) with the shard `failed` and a reason
label, so the reconciler hears why and places elsewhere. Otherwise it chooses the
engine's port, opens its KV event relay, builds its command line through the engine's
launch adapter (launch.py), starts it in its own session, and records all of it in the
shard's record before the agent supervises it: the record is what a restarted agent
re-adopts the engine from.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from llmgw import contracts as c
from llmgw.engines import ENGINES

from . import connector_folder, procs, validate
from .config import AgentConfig, parse_port_range
from .inventory import Inventory
from .kvrelay import EngineRelay, KvRelays
from .launch import ADAPTERS, LaunchContext, LaunchSpec, engine_environment, kv_events_off_reason
from .shard import EngineShard
from .state import ShardRecord, StateDir
from .telemetry import AgentMetrics

log = logging.getLogger(__name__)

S = c.ShardState


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
    """Every port these shards' records hold. An engine binds its port only once its
    model is loaded (minutes), so until then only the record says it is spoken for."""
    return {rec.port for rec in records if rec.port}


class Launcher:
    """Starts engines on this node. The agent owns the shards: the launcher makes a new
    one through `new_shard`, hands a started one to `supervise`, and reads the live ones
    (GPUs and ports they hold) through `live_shards`."""

    def __init__(
        self,
        cfg: AgentConfig,
        node: str,
        inventory: Inventory,
        state_dir: StateDir,
        engines: dict[str, str | None],
        kv_relays: KvRelays,
        metrics: AgentMetrics,
        *,
        new_shard: Callable[[ShardRecord], EngineShard],
        supervise: Callable[[EngineShard], None],
        live_shards: Callable[[], list[EngineShard]],
    ):
        self.cfg = cfg
        self.node = node
        self.inventory = inventory
        self.state_dir = state_dir
        self.engines = engines  # name -> None if installed, else why not
        self.kv_relays = kv_relays
        self.metrics = metrics
        self.new_shard = new_shard
        self.supervise = supervise
        self.live_shards = live_shards
        self.ports = parse_port_range(cfg.engine_port_range)
        self.bind_host = cfg.engine_bind_host or cfg.advertise_address
        self._last_port: int | None = None  # the port handed out last (see next_port)

    def start(self, cmd: c.StartShard, previous: EngineShard | None) -> str | None:
        """Launch the engine; None, or why not (a reason label: the shard is `failed`)."""
        rec = self._record(cmd, previous)
        refusal = validate.check(cmd, self._facts())  # before this shard counts as holding GPUs
        shard = self.new_shard(rec)
        if refusal is not None:
            self.metrics.validation_refusals.labels(refusal.check).inc()
            shard.transition(S.FAILED, reason=str(refusal))
            return "invalid"
        adapter = ADAPTERS[cmd.profile.engine]
        port = 0
        if adapter.serves_http(cmd):
            port = self._free_port() or 0
            if not port:
                reason = f"no free port in the engine port range {self.cfg.engine_port_range}"
                shard.transition(S.FAILED, reason=reason)
                return "no_free_port"
        relay = self._open_relay(cmd, port)
        spec = adapter.build(cmd, self._context(cmd, port, relay))
        self._note_launch(rec, spec, relay)
        shard.transition(S.LAUNCHING)
        try:
            proc = self._popen(spec, rec.log_path)
        except OSError as exc:
            shard.transition(S.FAILED, reason=f"cannot start {spec.argv[0]}: {exc.strerror or exc}")
            return "spawn_error"
        shard.proc = proc
        rec.pid = proc.pid
        rec.proc_start = procs.process_start(proc.pid)
        rec.kernel_boot_id = procs.kernel_boot_id()
        shard.transition(S.LOADING)
        self.supervise(shard)
        return None

    def _record(self, cmd: c.StartShard, previous: EngineShard | None) -> ShardRecord:
        # A relaunched shard keeps the keys it answered, so repeats of them stay answers,
        # and the adapters last asked for: its new engine holds none, so it loads them.
        keys = list(previous.rec.keys) if previous else []
        desired = list(previous.rec.desired_adapters) if previous else []
        return ShardRecord(
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
            desired_adapters=desired,
        )

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
            folder_unwritable=connector_folder.unwritable,
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

    def _open_relay(self, cmd: c.StartShard, port: int) -> EngineRelay | None:
        """The engine's KV event relay, or None: events off, or an engine serving no HTTP
        (no endpoint for routers to credit its blocks to)."""
        kv_events = self.cfg.kv_events and ENGINES[cmd.profile.engine].kv_events
        off = kv_events_off_reason(cmd.profile) if kv_events and port else ""
        if off:
            kv_events = False
            log.warning(
                "shard %s: %s KV events are off, routers use the approximate prefix scorer "
                "for it: %s",
                cmd.shard_id,
                cmd.profile.engine,
                off,
            )
        if not (kv_events and port):
            return None
        return self.kv_relays.open(cmd.shard_id)

    def _context(self, cmd: c.StartShard, port: int, relay: EngineRelay | None) -> LaunchContext:
        return LaunchContext(
            port=port,
            gpu_indices=[self.inventory.gpus[g].index for g in cmd.gpus],
            bind_host=self.bind_host,
            command=self.cfg.engine_commands()[cmd.profile.engine],
            kv_events_endpoint=relay.endpoint if relay else "",
            kv_replay_endpoint=relay.replay_endpoint if relay else "",
        )

    def _note_launch(self, rec: ShardRecord, spec: LaunchSpec, relay: EngineRelay | None) -> None:
        rec.port = spec.port
        rec.advertised = spec.advertised
        rec.url = (
            f"http://{self.cfg.advertise_address}:{spec.port}"
            if spec.advertised and spec.port
            else ""
        )
        if relay is not None:
            relay.url = rec.url
            rec.kv_events_endpoint = relay.endpoint
            rec.kv_replay_endpoint = relay.replay_endpoint
        rec.argv = spec.argv
        rec.launched_at = time.time()

    def _popen(self, spec: LaunchSpec, log_path: str) -> subprocess.Popen:
        with open(log_path, "wb") as out:
            return subprocess.Popen(
                spec.argv,
                env=engine_environment(os.environ, spec),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Its own session: signals to the agent's process group (a Ctrl-C, a
                # service manager stopping the agent) do not reach the engine.
                start_new_session=True,
                cwd=self.state_dir.root,
            )
