"""The agent's state directory: one JSON record per shard, engine logs, and a lock.

Engines belong to the node, not to the agent process, so what the agent launched
is written down before and after every transition. A restarted agent reads the
records back, re-adopts the engines still alive, and answers repeated commands
for shards that ended before the restart (command keys are kept).

Layout:  agent.lock   shards/<shard>.json   logs/<shard>.log
         kv/<hash>.ev, kv/<hash>.rp   (engines' KV event sockets, mode 0700: kvsockets)
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from llmgw import contracts as c

from . import kvsockets

log = logging.getLogger(__name__)

Contract = TypeVar("Contract", bound=msgspec.Struct)

KEEP_FINISHED = 200  # records of stopped / failed shards kept for idempotent answers


class StateDirBusy(RuntimeError):
    pass


class ShardRecord(msgspec.Struct, kw_only=True):
    shard_id: str
    model: str
    replica_id: str
    shard_index: int = 0
    engine: str = "sim"
    state: c.ShardState = c.ShardState.PENDING
    command_key: str = ""  # the latest command this shard answers
    keys: list[str] = msgspec.field(default_factory=list)  # every command key handled
    start: c.StartShard | None = None
    gpus: list[str] = msgspec.field(default_factory=list)
    port: int = 0
    url: str = ""
    advertised: bool = True
    pid: int | None = None
    proc_start: int | None = None  # /proc start time: the pid's identity
    kernel_boot_id: str = ""
    argv: list[str] = msgspec.field(default_factory=list)
    log_path: str = ""
    launched_at: float = 0.0
    stopping: bool = False
    stop_grace: float = 10.0
    # Wall clock, so a drain survives an agent restart.
    drain_started: float | None = None
    drain_deadline: float | None = None
    reason: str = ""
    exit_code: int | None = None
    output_tail: list[str] = msgspec.field(default_factory=list)
    max_running: int | None = None
    # The engine's KV event publisher and replay socket (ipc:// endpoints it binds, the
    # relay connects), kept for as long as the engine runs; "": no KV events.
    kv_events_endpoint: str = ""
    kv_replay_endpoint: str = ""
    # LoRA adapters: the set last asked for (SetShardAdapters; a relaunched engine gets it
    # again), what the engine holds (None: no adapter slots) and each failed call's answer.
    desired_adapters: list[c.AdapterSource] = msgspec.field(default_factory=list)
    adapters: list[str] | None = None
    adapter_errors: dict[str, str] = msgspec.field(default_factory=dict)
    updated_at: float = 0.0

    @property
    def terminal(self) -> bool:
        return self.state in c.TERMINAL_SHARD_STATES

    def info(self) -> c.ShardInfo:
        """The shard as registration reports it."""
        return self.as_contract(c.ShardInfo)

    def as_contract(self, cls: type[Contract], **given: Any) -> Contract:
        """`cls` (a contract struct about one shard) holding this record's fields of the
        same names, plus `given`. The record names its fields as the contracts do, so a
        shard field is mapped here once instead of copied by hand into each message;
        lists are copied, so the message never shares them with the record."""
        mine = {name: getattr(self, name) for name in cls.__struct_fields__ if name in _FIELDS}
        return msgspec.convert({**mine, **given}, cls)


_FIELDS = frozenset(ShardRecord.__struct_fields__)


def file_name(shard_id: str) -> str:
    """A shard id as a safe file name (ids come over the wire)."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", shard_id).lstrip(".") or "_"


class _LoopbackKvPorts(msgspec.Struct):
    """What a record written by an agent from before ipc KV sockets says that today's
    ShardRecord has no field for (decoding it as a ShardRecord drops these silently)."""

    shard_id: str
    kv_events_port: int = 0  # the agent's relay for the engine, on loopback TCP
    kv_replay_port: int = 0  # the engine's replay socket, on loopback TCP


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ShardRecord)
_loopback_decoder = msgspec.json.Decoder(_LoopbackKvPorts)


class StateDir:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.shards = self.root / "shards"
        self.logs = self.root / "logs"
        self.kv_sockets = self.root / kvsockets.DIR_NAME
        self._lock_fd: int | None = None

    def open(self) -> StateDir:
        """Create the layout and take the lock: two agents on one state dir would fight."""
        for d in (self.root, self.shards, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        kvsockets.prepare(self.kv_sockets)
        fd = os.open(self.root / "agent.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateDirBusy(
                f"state dir {self.root} is in use by another agent process"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        return self

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def log_path(self, shard_id: str) -> Path:
        return self.logs / f"{file_name(shard_id)}.log"

    def save(self, rec: ShardRecord) -> None:
        rec.updated_at = time.time()
        path = self.shards / f"{file_name(rec.shard_id)}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(_encoder.encode(rec))
        os.replace(tmp, path)  # atomic: a crash leaves the old record or the new one

    def load_all(self) -> list[ShardRecord]:
        out = []
        for path in sorted(self.shards.glob("*.json")):
            try:
                out.append(_decoder.decode(path.read_bytes()))
            except (OSError, msgspec.DecodeError) as exc:
                log.warning("ignoring unreadable shard record %s: %s", path, exc)
        return out

    def loopback_kv_ports(self) -> dict[str, tuple[int, int]]:
        """Shards whose engine an older agent launched with its KV sockets on loopback TCP:
        shard id -> (event port, replay port). Any local user can reach those ports until
        the engine is relaunched; the new agent relays nothing for it."""
        out = {}
        for path in sorted(self.shards.glob("*.json")):
            try:
                old = _loopback_decoder.decode(path.read_bytes())
            except (OSError, msgspec.DecodeError):
                continue  # load_all says so
            if old.kv_events_port or old.kv_replay_port:
                out[old.shard_id] = (old.kv_events_port, old.kv_replay_port)
        return out

    def prune(self, records: list[ShardRecord], keep: int = KEEP_FINISHED) -> list[ShardRecord]:
        """Forget the oldest finished shards beyond `keep`; returns the records dropped."""
        finished = sorted((r for r in records if r.terminal), key=lambda r: r.updated_at)
        dropped = finished[: max(0, len(finished) - keep)]
        for rec in dropped:
            (self.shards / f"{file_name(rec.shard_id)}.json").unlink(missing_ok=True)
            self.log_path(rec.shard_id).unlink(missing_ok=True)
        return dropped


def tail(path: str | Path, lines: int) -> list[str]:
    """The last `lines` lines of a log file (reads only its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace").splitlines()
    return [line[-500:] for line in text[-lines:]]
