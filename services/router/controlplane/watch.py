"""Watching one JetStream KV bucket: a whole snapshot first, then every change.

Not nats-py's `kv.watchall()`: its ordered consumer has no idle heartbeat, so
after a server restart it noticed the loss only when its consumer was
recreated, 7-16 s late (measured). Here an ordered push consumer on
`$KV.<bucket>.>` with `DeliverPolicy.LAST_PER_SUBJECT` and a 1 s idle
heartbeat reads the `KV-Operation` header itself (DEL and PURGE remove a key).
On top of that the owner calls `restart()` from the connection's reconnected
callback, and every `check_every` seconds the watcher checks that its stream
still is the one it subscribed to (a deleted and recreated bucket would leave
an ordered consumer waiting at a sequence the new stream never reaches).

Each (re)start delivers a fresh snapshot: every live key with its value, in
one `on_snapshot(entries)` call, so the owner can replace its state whole and
drop keys deleted while it was not looking. Until the bucket exists (the
reconciler creates it; under mTLS a router may not) the watcher waits, with
backoff, and logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

log = logging.getLogger(__name__)

KV_OPERATION = "KV-Operation"
REMOVALS = ("DEL", "PURGE")


@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    value: bytes
    written_at: float  # wall-clock time the server stored it


class BucketWatcher:
    """Calls `on_snapshot(dict key -> Entry)`, then `on_put(Entry)` / `on_delete(key)`.

    Callbacks run on the watcher's task, one at a time, in the bucket's order; an
    exception in one is logged and the watch goes on.
    """

    def __init__(
        self,
        nc: NATS,
        bucket: str,
        *,
        on_snapshot: Callable[[dict[str, Entry]], None],
        on_put: Callable[[Entry], None],
        on_delete: Callable[[str], None],
        heartbeat: float = 1.0,
        check_every: float = 5.0,
    ):
        self.nc = nc
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}."
        self.on_snapshot = on_snapshot
        self.on_put = on_put
        self.on_delete = on_delete
        self.heartbeat = heartbeat
        self.check_every = check_every
        self.info: jsapi.StreamInfo | None = None  # the stream as of the latest (re)start
        self.snapshots = 0  # completed snapshots: 1 after the first, +1 per restart
        self.snapshot_done = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._generation: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kvwatch-{self.bucket}"
        )

    def restart(self) -> None:
        """Start over with a fresh snapshot (after a reconnect)."""
        if self._generation is not None:
            self._generation.cancel()

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        delay = 0.2
        while True:
            self._generation = asyncio.get_running_loop().create_task(self._watch())
            began = time.monotonic()
            try:
                await self._generation
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stopping or (task is not None and task.cancelling()):
                    self._generation.cancel()
                    raise
                log.info("watch of %s restarts", self.bucket)  # restart() asked
                delay = 0.2
                continue
            except Exception as exc:
                log.warning("watch of %s failed (%s); starting over", self.bucket, exc)
            if time.monotonic() - began > 30:
                delay = 0.2
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _wait_for_bucket(self, js) -> jsapi.StreamInfo:
        delay, waited, last_log = 0.2, 0.0, -1e9
        while True:
            try:
                return await js.stream_info(self.stream)
            except NotFoundError:
                reason = "it does not exist yet (the reconciler creates it)"
            except Exception as exc:  # not connected, timeouts: the same wait
                reason = f"{type(exc).__name__}: {exc}"
            if waited - last_log >= 30:
                log.warning("waiting for KV bucket %s: %s", self.bucket, reason)
                last_log = waited
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 5.0)

    async def _watch(self) -> None:
        js = self.nc.jetstream()
        info = await self._wait_for_bucket(js)
        sub = await js.subscribe(
            f"{self.prefix}>",
            stream=self.stream,
            ordered_consumer=True,
            idle_heartbeat=self.heartbeat,
            deliver_policy=jsapi.DeliverPolicy.LAST_PER_SUBJECT,
        )
        try:
            await self._consume(js, sub, info)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _consume(self, js, sub, info: jsapi.StreamInfo) -> None:
        self.info = info
        snapshot: dict[str, Entry] | None = {}
        # Nothing stored and nothing delivered: the snapshot is empty and complete.
        cinfo = await sub.consumer_info()
        if cinfo.num_pending == 0 and sub.delivered == 0:
            self._finish_snapshot({})
            snapshot = None
        next_check = time.monotonic() + self.check_every
        while True:
            timeout = max(0.05, next_check - time.monotonic())
            try:
                msg = await sub.next_msg(timeout=timeout)
            except TimeoutError:
                msg = None
            if msg is not None:
                pending = self._deliver(msg, snapshot)
                if snapshot is not None and pending == 0:
                    self._finish_snapshot(snapshot)
                    snapshot = None
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.check_every
                if not await self._same_stream(js, info):
                    return  # the caller starts over with a fresh snapshot

    def _deliver(self, msg, snapshot: dict[str, Entry] | None) -> int:
        meta = msg.metadata
        key = msg.subject[len(self.prefix) :]
        op = (msg.headers or {}).get(KV_OPERATION)
        entry = None if op in REMOVALS else Entry(key, msg.data, meta.timestamp.timestamp())
        if snapshot is not None:
            if entry is None:
                snapshot.pop(key, None)
            else:
                snapshot[key] = entry
            return meta.num_pending
        try:
            if entry is None:
                self.on_delete(key)
            else:
                self.on_put(entry)
        except Exception:
            log.exception("applying %s/%s failed", self.bucket, key)
        return meta.num_pending

    def _finish_snapshot(self, entries: dict[str, Entry]) -> None:
        try:
            self.on_snapshot(entries)
        except Exception:
            log.exception("applying the snapshot of %s failed", self.bucket)
        self.snapshots += 1
        self.snapshot_done.set()

    async def _same_stream(self, js, info: jsapi.StreamInfo) -> bool:
        if not self.nc.is_connected:
            return True  # the reconnected callback restarts the watch
        try:
            now = await js.stream_info(self.stream)
        except NotFoundError:
            log.warning("KV bucket %s was deleted; waiting for it", self.bucket)
            return False
        except Exception:
            return True  # a slow answer says nothing about the stream
        if now.created != info.created:
            log.warning("KV bucket %s was recreated; reading it afresh", self.bucket)
            return False
        return True
