"""KV cache events from the node's engines onto the bus, and snapshots on request.

Each engine the agent launches gets `--kv-events-config` naming two ipc:// endpoints in
the agent's socket directory (kvsockets: a Unix socket in a 0700 directory, so no other
user can publish into a relay or read an engine's history): the engine binds its ZMQ
PUB on the first, as vLLM, SGLang and the simulator do for an ipc endpoint, and the
relay's SUB connects to it (ZMQ connects again on its own whenever the engine is not,
or no longer, there). The relay

- keeps the engine's cached block set, each engine block hash mapped to its canonical
  hash (llmgw.kvblocks: chained over the token ids the event carries), so routers can
  hash a prompt the same way without knowing the engine's hash seed;
- publishes the changes, in order, batched every few milliseconds, as `KvEvents` on
  core NATS (`llmgw.kv.<node>.<shard>`), each batch naming the engine's own sequence
  numbers it covers and the relay's epoch, so a router sees any gap;
- answers `KvSnapshotRequest` on `llmgw.kvsnap.<node>.<shard>` with the whole set as
  of the last engine batch it applied, taken together with the pending batch (which
  is published first), so no published batch straddles a snapshot; a set too large
  for one message keeps its oldest blocks, whole prefixes from their roots.

Events are fire and forget: a batch lost on the bus is a gap, which routers repair
with a snapshot. A gap between the engine and the relay (ZMQ drops past its
high-water mark, or while no relay listened) is repaired from the engine's replay
socket when it has one (vLLM's `replay_endpoint`, a ROUTER the engine binds, holding
its last `buffer_steps` batches; kvwire has the frames): the relay holds back the
batches that arrive meanwhile, asks for the batches from the first missing one,
applies them in order (skipping what it has), then the held ones. A relay that
(re)attaches to a running engine asks for the whole buffer, so its block set is
rebuilt. A reply that pauses (the engine's ROUTER dropped the rest, end marker
included) is asked for again from the first batch missing. Replays take turns across
the agent's relays (KvRelays' gate), and a relay whose engine did not answer stops
replaying for a while. When the engine does not answer by the deadline, or no longer
buffers the gap, the rest is what it was before replay: the gap is counted and logged,
and the set may miss blocks or keep evicted ones until they are stored or removed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import zmq
import zmq.asyncio

from llmgw import contracts as c
from llmgw import kvblocks, kvwire, subjects

from . import kvsockets

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], Awaitable[None]]


class _Superseded(Exception):
    """A replay found the relay's state no longer its own (a new epoch, a newer replay)."""


# How often the relay's socket tries to join an engine's that is not there (yet).
_RECONNECT_MS = 10

# Bytes per hash in a JSON snapshot, at most (19 digits and a comma), for sizing replies.
_HASH_JSON_BYTES = 20


def _extra(keys: list, lora_name: str | None) -> bytes | None:
    """A block's extra keys as canonical hashes cover them: without the LoRA name vLLM
    puts first, since the chain's root already stands for the adapter."""
    if lora_name and keys and keys[0] == lora_name:
        keys = keys[1:]
    return kvblocks.extra_bytes(keys)


class BlockSet:
    """An engine's cached blocks: engine hash -> canonical hash. Pure; no I/O.

    A block's canonical hash covers its token ids and its extra keys (multimodal item
    hashes, cache salt: llmgw.kvblocks), so such a block never matches a plain one."""

    def __init__(self) -> None:
        self.canon: dict[kvwire.BlockHash, int] = {}
        self.block_size = 0
        self.orphans = 0  # stored blocks whose parent was unknown (not indexed)

    def apply(self, events: list[kvwire.Event]) -> list[c.KvBlockOp]:
        ops: list[c.KvBlockOp] = []
        canon = self.canon
        for ev in events:
            if isinstance(ev, kvwire.Stored):
                if ev.unusable:
                    # Not indexed (its canonical hashes are unknown), so blocks chained
                    # on it are orphans; the relay counted it as malformed.
                    continue
                self.block_size = ev.block_size
                if ev.parent is None:
                    h = kvblocks.root_for(ev.lora_name)
                else:
                    parent = canon.get(ev.parent)
                    if parent is None:
                        # Stored before the relay listened: its chain cannot be rebuilt.
                        self.orphans += len(ev.block_hashes)
                        continue
                    h = parent
                span = 4 * ev.block_size
                try:
                    data = kvblocks.token_bytes(ev.token_ids)
                except (OverflowError, TypeError):
                    self.orphans += len(ev.block_hashes)  # token ids outside uint32
                    continue
                extras = ev.extra_keys
                out = []
                for i, eh in enumerate(ev.block_hashes):
                    block = data[i * span : (i + 1) * span]
                    if len(block) < span:
                        break
                    if extras is None or extras[i] is None:
                        h = kvblocks.chain_bytes(h, block)
                    else:
                        h = kvblocks.chain_extra(h, block, _extra(extras[i], ev.lora_name))
                    canon[eh] = h
                    out.append(h)
                if out:
                    ops.append(c.KvBlockOp(op=c.KvOp.STORED, hashes=out))
            elif isinstance(ev, kvwire.Removed):
                out = [h for eh in ev.block_hashes if (h := canon.pop(eh, None)) is not None]
                if out:
                    ops.append(c.KvBlockOp(op=c.KvOp.REMOVED, hashes=out))
            else:
                canon.clear()
                ops.append(c.KvBlockOp(op=c.KvOp.CLEARED))
        return ops

    def hashes(self) -> list[int]:
        return list(self.canon.values())


class EngineRelay:
    """One engine's socket, block set and outgoing batches."""

    def __init__(
        self,
        node: str,
        shard_id: str,
        *,
        publish: Publish,
        endpoint: str,
        replay_endpoint: str = "",
        replay_timeout: float = 5.0,
        replay_quiet: float = 0.25,
        replay_queue_timeout: float = 30.0,
        replay_backoff: tuple[float, float] = (30.0, 600.0),
        replay_gate: asyncio.Semaphore | None = None,
        flush_seconds: float = 0.01,
        max_ops: int = 512,
        metrics=None,
        context: zmq.asyncio.Context | None = None,
    ):
        self.node = node
        self.shard_id = shard_id
        self.url = ""
        self.publish = publish
        self.metrics = metrics
        self.flush_seconds = flush_seconds
        self.max_ops = max_ops
        self.subject = subjects.kv_events(node, shard_id)
        self.blocks = BlockSet()
        self.epoch = secrets.token_hex(6)
        self.last_seq = -1  # the engine's last batch applied
        self.engine_gaps = 0  # gaps not repaired (batches lost for good)
        self.malformed = 0
        self.published = 0
        # The engine's replay socket ("" = none) and what asking it brought back.
        self.replay_endpoint = replay_endpoint
        self.replay_timeout = replay_timeout  # for one replay, from when its turn comes
        # vLLM sends a reply in one burst, so a pause this long after its first batch means
        # its ROUTER dropped the rest (silently, past its high-water mark of 1,000).
        self.replay_quiet = replay_quiet
        self.replay_queue_timeout = replay_queue_timeout  # the longest wait for a turn
        # Replays the owner lets run at once (one event loop serves every relay).
        self._gate = replay_gate or asyncio.Semaphore(1)
        # After a replay nobody answered, gaps are not replayed for a while (doubling).
        self._backoff_first, self._backoff_max = replay_backoff
        self._backoff = 0.0
        self._no_replay_until = 0.0  # time.monotonic()
        self.replays = 0  # requests sent
        self.replayed = 0  # batches applied from replies
        self.replays_skipped = 0  # gaps not replayed: during a back-off, or of our making
        self._live_seq = -1  # the last batch the engine's PUB sent us (not replayed)
        self._unreadable = False  # a live message whose sequence number we could not read
        self._held: list[tuple[int, list[kvwire.Event]]] = []  # live batches during a replay
        self._replay_task: asyncio.Task | None = None
        self._retired: set[asyncio.Task] = set()  # replays cancelled, not yet finished
        self._heard = False  # the current replay got any reply frame
        self._ops: list[c.KvBlockOp] = []
        self._first = -1
        self._flush_task: asyncio.Task | None = None
        # The owner's context (its I/O thread serves every relay's socket); closing a
        # socket only asks that thread to close the fd, terminating the context waits for it.
        self._context = context or zmq.asyncio.Context.instance()
        self._sock = self._context.socket(zmq.SUB)
        try:
            self._sock.setsockopt(zmq.SUBSCRIBE, b"")
            self._sock.setsockopt(zmq.RCVHWM, 100_000)
            self._sock.setsockopt(zmq.LINGER, 0)
            # The engine binds its socket, and batches it sends before this one has joined
            # are lost (noticed only with the next batch); ZMQ's 100 ms between tries to
            # connect would leave time for a whole first request. A failed try on a Unix
            # socket path costs a few system calls.
            self._sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
            self._sock.connect(endpoint)  # the engine binds it, now or later
        except zmq.ZMQError:
            self._sock.close(linger=0)
            raise
        self.endpoint = endpoint  # where the engine publishes
        self.task: asyncio.Task | None = None

    # -- the engine side -------------------------------------------------------------

    async def run(self) -> None:
        while True:
            parts = await self._sock.recv_multipart()
            self.receive(parts)

    def receive(self, parts: list[bytes]) -> None:
        """One batch from the engine's PUB socket."""
        parsed = self._parse(parts)
        if parsed is None:
            self._unreadable = True
            return
        seq, events = parsed
        # A gap right after a message we could not read may be that very message: the
        # engine would replay the same bytes, so asking is pointless.
        ours, self._unreadable = self._unreadable, False
        if seq <= self._live_seq:
            # Numbering started over: a new engine process behind the same socket.
            self._new_epoch()
        self._live_seq = seq
        if self.replaying:
            self._held.append((seq, events))
        elif seq <= self.last_seq:
            pass  # a replay brought it already
        elif seq == self.last_seq + 1 or not self.replay_endpoint:
            self._apply(seq, events)
        elif ours or time.monotonic() < self._no_replay_until:
            self.replays_skipped += 1
            self._apply(seq, events)  # the gap is counted, as without replay
        else:
            self._held.append((seq, events))
            self.request_replay()

    @property
    def replaying(self) -> bool:
        return self._replay_task is not None

    def request_replay(self) -> None:
        """Ask the engine for every batch after the last one applied; live batches are
        held back until the reply is in. At once on attaching to a running engine."""
        if self.replay_endpoint and self._replay_task is None:
            self._replay_task = asyncio.ensure_future(self._catch_up())

    def _parse(self, parts: list[bytes]) -> tuple[int, list[kvwire.Event]] | None:
        """(seq, events) of one engine message; a batch that cannot be read but whose
        sequence number can is (seq, []): its events are lost (counted as malformed), but
        it is no gap, since replay would bring the same bytes. None: not even that."""
        try:
            seq, _, events = kvwire.parse_frames(parts)
        except kvwire.WireError as exc:
            self.malformed += 1
            if self.malformed == 1 or self.malformed % 1000 == 0:
                log.warning("shard %s: skipped malformed KV events (%s)", self.shard_id, exc)
            if len(parts) == 3 and len(parts[1]) == 8:
                return int.from_bytes(parts[1], "big", signed=True), []
            return None
        for ev in events:
            if isinstance(ev, kvwire.Stored) and ev.unusable:
                self.malformed += 1
                if self.malformed == 1 or self.malformed % 1000 == 0:
                    log.warning(
                        "shard %s: KV blocks not indexed, malformed store (%s)",
                        self.shard_id,
                        ev.unusable,
                    )
        return seq, events

    def _apply(self, seq: int, events: list[kvwire.Event]) -> None:
        """The engine's batch `seq`, later than any applied: a jump is a gap for good."""
        if self.last_seq >= 0 and seq != self.last_seq + 1:
            self.engine_gaps += 1
            if self.metrics is not None:
                self.metrics.kv_engine_gaps.inc()
            log.warning(
                "shard %s: engine KV events %d..%d were lost before the relay",
                self.shard_id,
                self.last_seq + 1,
                seq - 1,
            )
        self.last_seq = seq
        ops = self.blocks.apply(events)
        if self._first < 0:
            self._first = seq
        self._ops.extend(ops)
        if len(self._ops) >= self.max_ops:
            self._schedule(0.0)
        else:
            self._schedule(self.flush_seconds)

    def _apply_held(self, *, across_gaps: bool, before: int | None = None) -> None:
        """Held live batches (those before `before`), in order, skipping those applied; up
        to the next gap unless `across_gaps` (what is still missing is lost)."""
        held = self._held
        i = 0
        while i < len(held):
            seq, events = held[i]
            if (seq > self.last_seq + 1 and not across_gaps) or (
                before is not None and seq >= before
            ):
                break
            if seq > self.last_seq:
                self._apply(seq, events)
            i += 1
        del held[:i]

    async def _catch_up(self) -> None:
        me = asyncio.current_task()
        outcome = ""  # of the last round; none ran: no turn came
        self._heard = False
        try:
            try:
                async with asyncio.timeout(self.replay_queue_timeout):
                    await self._gate.acquire()
            except TimeoutError:
                log.warning("shard %s: no turn for a KV event replay in time", self.shard_id)
                return
            try:
                self._still_current(me)
                # The deadline counts from this relay's turn, not from the wait for it.
                deadline = asyncio.get_running_loop().time() + self.replay_timeout
                while True:
                    before = self.last_seq
                    outcome = await self._replay_round(me, self.last_seq + 1, deadline)
                    self._apply_held(across_gaps=False)
                    if outcome == "failed" or self.last_seq == before:
                        return  # no answer, or the engine no longer buffers the gap
                    if outcome == "end" and not self._held:
                        return  # caught up
                    # The reply had a hole or lost its tail (the engine's ROUTER drops past
                    # its high-water mark when the relay reads too slowly), or a live batch
                    # after it went missing: ask again from there.
            finally:
                self._gate.release()
        except _Superseded:
            return  # a new epoch or a newer replay owns the state now
        except asyncio.CancelledError:
            if self._replay_task is me:
                self._replay_task = None
            raise
        except Exception:  # a bug here must not stop the relay: it goes on without replay
            log.exception("shard %s: KV event replay failed", self.shard_id)
        finally:
            if self._replay_task is me:
                self._replay_task = None
                if outcome:
                    self._after_replay(answered=self._heard)
                self._apply_held(across_gaps=True)

    def _after_replay(self, *, answered: bool) -> None:
        """Back off replaying while the engine's replay socket does not answer: each gap
        would otherwise hold live batches for the whole deadline again."""
        if answered:
            self._backoff = 0.0
            return
        self._backoff = min(self._backoff_max, max(self._backoff_first, 2 * self._backoff))
        self._no_replay_until = time.monotonic() + self._backoff
        log.warning(
            "shard %s: KV event gaps are not replayed for %.0f s (no answer from %s)",
            self.shard_id,
            self._backoff,
            self.replay_endpoint,
        )

    def _still_current(self, me: asyncio.Task | None) -> None:
        """After every await of a replay: a cancellation can be lost (on Python 3.11 a
        wait whose result was already in swallows it), so the replay checks it is still
        the relay's own before touching the state, which a new epoch has replaced."""
        if self._replay_task is not me:
            raise _Superseded

    async def _replay_round(self, me: asyncio.Task | None, start: int, deadline: float) -> str:
        """Ask for the batches from `start` and apply the reply's run that continues the
        applied ones: "end" (the whole reply came), "hole" (a batch inside it, or its
        tail, is missing: the rest is dropped) or "failed" (no end marker by the
        deadline, or a pause in the reply before any batch was applied)."""
        loop = asyncio.get_running_loop()
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # the engine's ROUTER decides what it drops
        self.replays += 1
        first = True
        heard = False
        n = 0
        try:
            sock.connect(self.replay_endpoint)
            async with asyncio.timeout_at(deadline):
                await sock.send_multipart(kvwire.replay_request(start))
            self._still_current(me)
            while True:
                # The first frame may be slow (vLLM's publisher thread looks at its replay
                # socket between 100 ms waits on its queue); the rest come in one burst.
                until = min(deadline, loop.time() + self.replay_quiet) if heard else deadline
                try:
                    async with asyncio.timeout_at(until):
                        raw = await sock.recv_multipart()
                except TimeoutError:
                    if until >= deadline or n == 0:
                        raise
                    return "hole"  # its tail and end marker were dropped
                self._still_current(me)
                heard = self._heard = True
                parts = kvwire.parse_replay(raw)
                if parts is None:
                    return "end"
                parsed = self._parse(parts)
                if parsed is None:
                    continue
                seq, events = parsed
                if seq <= self.last_seq:
                    continue  # already applied
                if seq > self.last_seq + 1:
                    if not first:
                        # A hole inside the reply: keep what came in order, ask again.
                        return "hole"
                    # The engine no longer buffers the gap's start: that part is gone, but
                    # live batches held before this one are still worth applying.
                    self._apply_held(across_gaps=True, before=seq)
                    if seq <= self.last_seq:
                        continue
                first = False
                self._apply(seq, events)
                self.replayed += 1
                if self.metrics is not None:
                    self.metrics.kv_replayed.inc()
                n += 1
                if len(self._ops) >= self.max_ops:
                    await self.flush()  # keep each bus message small
                    self._still_current(me)
                elif n % 256 == 0:
                    await asyncio.sleep(0)  # a long reply must not starve the agent
                    self._still_current(me)
        except (TimeoutError, zmq.ZMQError) as exc:
            if self.metrics is not None:
                self.metrics.kv_replay_failures.inc()
            log.warning(
                "shard %s: no KV event replay from %s (%s); %d batches replayed",
                self.shard_id,
                self.replay_endpoint,
                type(exc).__name__,
                n,
            )
            return "failed"
        finally:
            sock.close(linger=0)

    def _new_epoch(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            # Cancelled, and also no longer current: should the cancellation be lost, the
            # replay still stops at its next await (_still_current). Kept until it ends.
            task.cancel()
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)
        self._held.clear()
        self._ops.clear()
        self._first = -1
        self.blocks = BlockSet()
        self.epoch = secrets.token_hex(6)
        self.last_seq = -1
        self._live_seq = -1

    # -- the bus side ----------------------------------------------------------------

    def _schedule(self, delay: float) -> None:
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.ensure_future(self._flush_later(delay))

    async def _flush_later(self, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        await self.flush()

    def take_batch(self) -> c.KvEvents | None:
        """The pending changes as one message (cleared from pending), or None."""
        if self._first < 0:
            return None
        msg = c.KvEvents(
            node=self.node,
            shard_id=self.shard_id,
            url=self.url,
            epoch=self.epoch,
            seq_first=self._first,
            seq_last=self.last_seq,
            block_size=self.blocks.block_size,
            ops=self._ops,
        )
        self._ops = []
        self._first = -1
        return msg

    async def flush(self) -> None:
        await self._send(self.take_batch())

    async def _send(self, msg: c.KvEvents | None) -> None:
        if msg is None:
            return
        try:
            await self.publish(self.subject, c.encode(msg))
            self.published += 1
            if self.metrics is not None:
                self.metrics.kv_batches.inc()
        except Exception as exc:  # the bus is down: routers will see the gap and resync
            log.debug("shard %s: KV events not published: %s", self.shard_id, exc)
            if self.metrics is not None:
                self.metrics.publish_failures.labels("kv_events").inc()

    def take_snapshot(self, max_payload: int) -> tuple[c.KvEvents | None, c.KvSnapshot]:
        """The pending batch and the set as of its last sequence number, taken together
        with no await between them: engine batches arriving while the pending one is
        published go into the next batch, after the snapshot, never across it.

        Past `max_payload` the oldest blocks are kept: they are stored before the blocks
        chained on them, so the set stays whole prefixes (roots first) and a router
        still matches the start of every prompt, where the leaves would match none.
        """
        pending = self.take_batch()
        hashes = self.blocks.hashes()
        room = max(0, (max_payload - 2048) // _HASH_JSON_BYTES)
        snap = c.KvSnapshot(
            node=self.node,
            shard_id=self.shard_id,
            url=self.url,
            epoch=self.epoch,
            seq=self.last_seq,
            block_size=self.blocks.block_size,
            hashes=hashes[:room] if len(hashes) > room else hashes,
            truncated=len(hashes) > room,
        )
        return pending, snap

    async def snapshot(self, max_payload: int) -> c.KvSnapshot:
        """The snapshot, after publishing the batch that preceded it."""
        pending, snap = self.take_snapshot(max_payload)
        await self._send(pending)
        return snap

    def start(self, *, engine_running: bool = False) -> None:
        """Listen; `engine_running`: the engine was up before (an adopted engine), so
        ask it to replay its buffer, which rebuilds the set stored meanwhile."""
        self.task = asyncio.ensure_future(self.run())
        if engine_running:
            self.request_replay()

    def close_socket(self) -> None:
        for task in (self.task, self._flush_task, self._replay_task, *self._retired):
            if task is not None:
                task.cancel()
        self._sock.close(linger=0)

    async def close(self) -> None:
        for task in (self.task, self._flush_task, self._replay_task, *self._retired):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._sock.close(linger=0)


class KvRelays:
    """The agent's relays, by shard id, and the node's snapshot service."""

    def __init__(self, node: str, socket_dir: Path, metrics=None, replays_at_once: int = 2):
        self.node = node
        self.socket_dir = socket_dir  # kvsockets: the engines' endpoints, this user's only
        self.metrics = metrics  # telemetry.AgentMetrics, or None
        self.relays: dict[str, EngineRelay] = {}
        self._nc = None
        self._sub = None
        self._closing: set[asyncio.Future] = set()
        self._context = zmq.asyncio.Context()
        # Replays running at once, across relays: after an agent restart every adopted
        # engine's relay asks for its whole buffer, and one event loop reads the replies.
        self._replay_gate = asyncio.Semaphore(replays_at_once)

    async def _publish(self, subject: str, data: bytes) -> None:
        nc = self._nc
        if nc is None or not nc.is_connected:
            raise ConnectionError("not connected to NATS")
        await nc.publish(subject, data)

    def open(
        self,
        shard_id: str,
        endpoints: tuple[str, str] | None = None,
        *,
        engine_running: bool = False,
    ) -> EngineRelay:
        """Connect a relay for this shard to its engine's sockets and start it.
        `endpoints`: the engine's (events, replay) endpoints, as its launch recorded them;
        None: the shard's own in the socket directory, for an engine about to start.
        `engine_running`: the engine is up already (adopted), so the relay asks it to
        replay its buffer at once."""
        old = self.relays.pop(shard_id, None)
        if old is not None:
            # Its socket closes now; stop() awaits the rest of its shutdown.
            old.close_socket()
            task = asyncio.ensure_future(old.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        events, replay = endpoints or kvsockets.endpoints(self.socket_dir, shard_id)
        relay = EngineRelay(
            self.node, shard_id, publish=self._publish, endpoint=events, replay_endpoint=replay,
            metrics=self.metrics, context=self._context, replay_gate=self._replay_gate,
        )  # fmt: skip
        relay.start(engine_running=engine_running)
        self.relays[shard_id] = relay
        return relay

    async def close(self, shard_id: str) -> None:
        relay = self.relays.pop(shard_id, None)
        if relay is not None:
            await relay.close()

    async def attach(self, nc) -> None:
        """Start answering snapshot requests on this connection."""
        self._nc = nc
        self._sub = await nc.subscribe(subjects.kv_snapshots_of(self.node), cb=self._on_request)

    async def _on_request(self, msg) -> None:
        if not msg.reply:
            return
        token = msg.subject.rsplit(".", 1)[-1]
        relay = next(
            (r for r in self.relays.values() if subjects.safe_token(r.shard_id) == token), None
        )
        if relay is None:
            return  # no such engine here: the asker times out and treats it as silent
        snap = await relay.snapshot(self._nc.max_payload)
        with contextlib.suppress(Exception):
            await msg.respond(c.encode(snap))

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        for shard_id in list(self.relays):
            await self.close(shard_id)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        # A closed socket's connections are torn down by ZMQ's I/O thread a moment later;
        # terminating the context waits for that, so once the agent has stopped none of
        # its relays holds an engine's socket. destroy() first closes, with linger 0, any
        # socket still open (a replay request cut short), so the wait cannot hang.
        self._context.destroy(linger=0)
