"""Worker snapshots: how several router processes share one admin listener.

With `--workers N` each worker is its own process with its own counters, view
and circuits. Each worker writes a snapshot (metrics series, readiness, the
endpoints as it sees them) to a directory the parent created, every half
second; the parent's admin listener reads and merges them. Files of workers
that died are kept for their counters (so totals never go backwards) but no
longer count for gauges or readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from llmgw.tasks import cancel_and_wait

INTERVAL = 0.5
WRITE_WAIT_SECONDS = 5.0  # a write that takes longer has lost the disk; the last one goes anyway
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class Snapshot(msgspec.Struct):
    pid: int
    written_at: float  # wall clock
    ready: bool
    metrics: dict[str, list[list[Any]]]
    endpoints: list[dict[str, Any]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_all(directory: Path) -> list[tuple[Snapshot, bool]]:
    """Every worker's latest snapshot, and whether that worker is still alive."""
    out = []
    for path in sorted(directory.glob("worker-*.snap")):
        try:
            raw = _decoder.decode(path.read_bytes())
            snap = msgspec.convert(raw, Snapshot)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue  # being replaced right now, or from an older version
        out.append((snap, _alive(snap.pid)))
    return out


class Writer:
    """The worker side: a task that writes this process's snapshot periodically.

    Writes run in a thread, and one stuck on a lost disk can outlive the wait at stop:
    so each write goes to its own temporary file, and a snapshot replaces the file only
    if it is newer than the last one that did (the final flush is never overwritten by
    an older write finishing late, so a dead worker's counters never go backwards)."""

    def __init__(self, directory: Path, make: Callable[[], Snapshot]):
        self.directory = directory
        self.make = make
        self._task: asyncio.Task | None = None
        self._writing: asyncio.Future | None = None
        self._seq = itertools.count(1)
        self._renamed = 0  # seq of the snapshot the file holds
        self._rename_lock = threading.Lock()

    def start(self) -> None:
        self.flush()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def flush(self) -> None:
        self._write(self.make(), next(self._seq))

    def _write(self, snap: Snapshot, seq: int) -> None:
        path = self.directory / f"worker-{snap.pid}.snap"
        tmp = path.with_suffix(f".{seq}.tmp")
        try:
            tmp.write_bytes(_encoder.encode(snap))
            with self._rename_lock:
                if seq > self._renamed:
                    os.replace(tmp, path)
                    self._renamed = seq
                    return
            tmp.unlink()
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL)
            snap = self.make()  # on the loop: the state it reads is the loop's
            # The file write and rename leave the loop: on a busy disk they took
            # milliseconds, twice a second, and every request in flight waited.
            seq = next(self._seq)
            self._writing = asyncio.ensure_future(asyncio.to_thread(self._write, snap, seq))
            await asyncio.shield(self._writing)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._writing is not None:
            # A write still in its thread must land before the last one, not over it.
            await asyncio.wait({self._writing}, timeout=WRITE_WAIT_SECONDS)
            self._writing = None
        self.flush()
