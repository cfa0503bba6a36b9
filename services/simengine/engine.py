"""The simulated engine: continuous batching over a KV block pool, as pure logic.

The engine never reads a clock or sleeps. `step(now)` does whatever work is due at `now` and
returns the requests whose output changed; `next_step_at()` says when more work falls due. The
asyncio driver calls it in real time; unit tests call it with invented times.

The model, in vLLM's terms:
- at most `max_num_seqs` requests run; the rest wait in FIFO order, and the head of the queue
  blocks the others (no skipping ahead) when it cannot get a slot or KV blocks;
- a running request holds ceil((prompt + generated) / block_size) blocks; admission takes the
  longest cached prefix of its prompt blocks and allocates the rest;
- each request's prefill takes ttft + uncached prompt tokens * prefill_per_token, independently
  of the others, and ends with its first token;
- decode proceeds in steps: every decoding request gets one token per step, and a step lasts
  itl + itl_per_running * running;
- a token that needs a new block and finds none preempts the most recently admitted running
  request (possibly itself): its blocks are freed, it goes back to the head of the queue, and
  on readmission it recomputes its prompt and the tokens generated so far;
- an abort takes effect at the next step, freeing the request's blocks and slot.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from llmgw.simengine.kvcache import BlockPool
from llmgw.simengine.stats import Stats


class State(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class EngineParams:
    max_num_seqs: int = 256
    num_blocks: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Seconds.
    ttft: float = 0.0
    prefill_per_token: float = 0.0
    itl: float = 0.0
    itl_per_running: float = 0.0


@dataclass(slots=True, eq=False)
class Request:
    prompt_tokens: int
    max_output: int
    # Why the request ends once it has produced max_output tokens: "length" or "stop".
    final_reason: str = "length"
    block_hashes: tuple[int, ...] = ()
    # The prompt's bytes: the token ids KV events carry are cut from them.
    prompt: bytes = b""
    # vLLM's cache_salt: the first block's hash (and KV event extra keys) covers it.
    cache_salt: str | None = None
    # The LoRA adapter it runs under (its model name), None for the base model.
    lora_name: str | None = None
    # Faults: stop producing (but keep slot and blocks) after this many tokens; delay the first.
    hang_after: int | None = None
    first_token_delay: float = 0.0

    # Owned by the engine.
    state: State = State.WAITING
    arrival: float = 0.0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prefilled: bool = False
    first_token_at: float | None = None
    last_token_at: float = 0.0
    finished_reason: str | None = None
    abort_requested: bool = False
    # Bumped on preemption so the stale prefill entry in the heap is skipped.
    epoch: int = 0

    # The shell's wake-up hook (an asyncio future); the engine never touches it.
    waiter: Any = None

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED


class Engine:
    def __init__(self, params: EngineParams):
        self.params = params
        self.pool = BlockPool(params.num_blocks)
        self.stats = Stats()
        self.waiting: deque[Request] = deque()
        # Insertion-ordered: the last key is the most recently admitted, the preemption victim.
        self.running: dict[Request, None] = {}
        self._decoding: dict[Request, None] = {}
        self._prefills: list[tuple[float, int, int, Request]] = []  # (done_at, seq, epoch, req)
        self._aborts: list[Request] = []
        self._decode_due: float | None = None
        self._seq = 0
        # Told which prompt blocks became cached (simengine.kvevents.Publisher); None: off.
        self.kv_events: Any = None

    # -- inputs ---------------------------------------------------------------------------

    def add(self, req: Request, now: float) -> None:
        req.arrival = now
        req.state = State.WAITING
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Ask for `req` to be aborted; it happens at the next step."""
        if req.state is not State.FINISHED and not req.abort_requested:
            req.abort_requested = True
            self._aborts.append(req)

    # -- the step loop --------------------------------------------------------------------

    def step(self, now: float) -> list[Request]:
        """Do the work due at `now`; return the requests that produced tokens or finished."""
        touched: list[Request] = []
        if self._aborts:
            for req in self._aborts:
                if req.state is not State.FINISHED:
                    self._finish(req, "abort", now)
                    touched.append(req)
            self._aborts.clear()
        # Decode before completing prefills, so a fresh first token is not followed by a second
        # in the same step.
        if self._decode_due is not None and now >= self._decode_due:
            self._decode(now, touched)
        if self._prefills and self._prefills[0][0] <= now:
            self._complete_prefills(now, touched)
        # Admit last, into the slots and blocks this step freed.
        if self.waiting:
            self._admit(now)
        return touched

    def next_step_at(self) -> float | None:
        """When work next falls due (possibly already), or None when idle until a new input."""
        if self._aborts:
            return float("-inf")
        heap = self._prefills
        while heap and (heap[0][3].epoch != heap[0][2] or heap[0][3].state is not State.RUNNING):
            heapq.heappop(heap)
        due = self._decode_due
        if heap and (due is None or heap[0][0] < due):
            due = heap[0][0]
        return due

    def step_duration(self) -> float:
        return self.params.itl + self.params.itl_per_running * len(self.running)

    # -- internals ------------------------------------------------------------------------

    def _admit(self, now: float) -> None:
        p = self.params
        bs = p.block_size
        while self.waiting and len(self.running) < p.max_num_seqs:
            req = self.waiting[0]
            tokens = req.prompt_tokens + req.generated
            total = -(-tokens // bs)
            hits: list[int] = []
            if p.enable_prefix_caching and req.block_hashes:
                # At least one prompt token is always computed: it yields the next token.
                usable = (req.prompt_tokens - 1) // bs
                hits = self.pool.match(req.block_hashes[:usable])
            if not self.pool.can_allocate(total - len(hits), hits):
                break
            self.waiting.popleft()
            self.pool.acquire(hits)
            req.blocks = hits + self.pool.allocate(total - len(hits))
            req.cached_tokens = len(hits) * bs
            self.stats.prefix_cache_queries += req.prompt_tokens
            self.stats.prefix_cache_hits += req.cached_tokens
            delay = p.ttft + (tokens - req.cached_tokens) * p.prefill_per_token
            if not req.prefilled:
                delay += req.first_token_delay
            req.state = State.RUNNING
            self.running[req] = None
            self._seq += 1
            heapq.heappush(self._prefills, (now + delay, self._seq, req.epoch, req))

    def _complete_prefills(self, now: float, touched: list[Request]) -> None:
        heap = self._prefills
        while heap and heap[0][0] <= now:
            _, _, epoch, req = heapq.heappop(heap)
            if req.epoch != epoch or req.state is not State.RUNNING:
                continue
            if self.params.enable_prefix_caching:
                pairs = zip(req.blocks, req.block_hashes, strict=False)
                new = [i for i, (b, h) in enumerate(pairs) if self.pool.register(b, h)]
                if new and self.kv_events is not None:
                    self.kv_events.stored(req, new)
            if not req.prefilled:
                req.prefilled = True
                self.stats.prompt_tokens += req.prompt_tokens
            if req.generated >= req.max_output:
                self._finish(req, req.final_reason, now)
                touched.append(req)
            elif req.hang_after is None or req.generated < req.hang_after:
                # The prefill's forward pass yields the next token.
                self._emit(req, now, touched)
        if self._decoding and self._decode_due is None:
            self._decode_due = now + self.step_duration()

    def _decode(self, now: float, touched: list[Request]) -> None:
        for req in list(self._decoding):
            # An earlier request in this step may have preempted this one.
            if req in self._decoding:
                self._emit(req, now, touched)
        if not self._decoding:
            self._decode_due = None
            return
        # Keep the step cadence when this step ran a little late (timer and scheduling
        # jitter); restart it from now when a whole step was missed.
        due = self._decode_due + self.step_duration()
        self._decode_due = due if due > now else now + self.step_duration()

    def _emit(self, req: Request, now: float, touched: list[Request]) -> None:
        """Produce one token for `req`, first finding a KV slot for it (preempting if need be)."""
        needed = -(-(req.prompt_tokens + req.generated + 1) // self.params.block_size)
        while len(req.blocks) < needed:
            if self.pool.free:
                req.blocks += self.pool.allocate(1)
                continue
            victim = next(reversed(self.running))
            self._preempt(victim)
            if victim is req:
                return
        req.generated += 1
        self.stats.generation_tokens += 1
        if req.first_token_at is None:
            req.first_token_at = now
            self.stats.ttft.observe(now - req.arrival)
        else:
            self.stats.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        touched.append(req)
        if req.generated >= req.max_output:
            self._finish(req, req.final_reason, now)
        elif req.hang_after is not None and req.generated >= req.hang_after:
            # Wedged: keeps its slot and blocks, produces nothing until aborted.
            self._stop_decoding(req)
        else:
            self._decoding[req] = None

    def _stop_decoding(self, req: Request) -> None:
        self._decoding.pop(req, None)
        if not self._decoding:
            self._decode_due = None

    def _preempt(self, req: Request) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        del self.running[req]
        self._stop_decoding(req)
        req.state = State.WAITING
        req.epoch += 1
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _finish(self, req: Request, reason: str, now: float) -> None:
        if req.state is State.WAITING:
            self.waiting.remove(req)
        self.pool.release(req.blocks)
        req.blocks = []
        self.running.pop(req, None)
        self._stop_decoding(req)
        req.state = State.FINISHED
        req.finished_reason = reason
        self.stats.finished[reason] += 1
        self.stats.e2e.observe(now - req.arrival)

    # -- introspection --------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks_used": self.pool.used,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_cached": self.pool.cached,
            "kv_cache_usage": self.pool.used / self.pool.num_blocks,
            "finished": s.finished["stop"] + s.finished["length"],
            "aborted": s.finished["abort"],
            "finished_by_reason": dict(s.finished),
            "preemptions": s.preemptions,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
        }
