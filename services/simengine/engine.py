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
- with `enable_chunked_prefill`, prefills stop running on their own timers and share the
  decode steps instead (batch.py): a step carries every decoding request's next token plus
  prompt chunks up to `max_num_batched_tokens`, and lasts longer by the chunks' compute, so a
  long prompt stalls every running decode, as in vLLM;
- a decode leg of prefill/decode disaggregation (`external_prefill`) takes its prompt's KV
  from the prefill engine: no prefill compute, only `kv_transfer` before its first token, and
  the tokens count as external hits, as vLLM's KV connector counts them;
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

from llmgw.simengine import batch
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
    # A decode leg's wait for its prompt's KV from the prefill engine.
    kv_transfer: float = 0.0
    # Prefill chunks share the decode steps under a token budget (batch.py); off: prefills
    # run on their own timers, as the simulator always did.
    enable_chunked_prefill: bool = False
    max_num_batched_tokens: int = 2048


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
    # A decode leg (kv_transfer_params.do_remote_prefill): the prompt's KV comes from the
    # prefill engine, on the first admission only (after a preemption it is recomputed, as
    # vLLM clears do_remote_prefill once the transfer is done).
    external_prefill: bool = False

    # Owned by the engine.
    state: State = State.WAITING
    arrival: float = 0.0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prefilled: bool = False
    # Chunked prefill: tokens of this admission's prefill still to compute, and when
    # the request may join a step (a decode leg's KV transfer, a slow-first-token fault).
    prefill_left: int = 0
    ready_at: float = 0.0
    # The blocks it held when it finished: a prefill leg's answer names them.
    final_blocks: list[int] = field(default_factory=list)
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
        # Chunked prefill: the step in flight (planned when it starts, run when it is due).
        self._step: batch.Step | None = None
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
        if self.params.enable_chunked_prefill:
            self._step_chunked(now, touched)
            return touched
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
        if self.params.enable_chunked_prefill:
            if self._step is not None:
                return self._step.due
            # Idle but for prefills not ready yet (a KV transfer, a slow first token).
            return min((r.ready_at for r in self.running if r.prefill_left > 0), default=None)
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
            req.state = State.RUNNING
            self.running[req] = None
            self._start_prefill(req, len(hits) * bs, now)

    def _start_prefill(self, req: Request, cached: int, now: float) -> None:
        """Count the prompt's tokens by source and set the prefill going: on its own timer,
        or (chunked prefill) as work for the coming steps."""
        p = self.params
        s = self.stats
        s.prefix_cache_queries += req.prompt_tokens
        s.prefix_cache_hits += cached
        # vLLM counts the sources of a request's first scheduled prefill only.
        first = req.epoch == 0
        if first:
            s.prompt_tokens_by_source["local_cache_hit"] += cached
        delay = 0.0 if req.prefilled else req.first_token_delay
        if req.external_prefill and first:
            # Everything the local cache lacks comes from the prefill engine; vLLM still
            # runs the last prompt token to get the first token's logits (one token).
            external = req.prompt_tokens - cached
            s.external_prefix_cache_queries += external
            s.external_prefix_cache_hits += external
            s.prompt_tokens_by_source["external_kv_transfer"] += external
            req.cached_tokens = req.prompt_tokens
            delay += p.kv_transfer
            compute = 1
        else:
            req.cached_tokens = cached
            compute = req.prompt_tokens + req.generated - cached
            if first:
                s.prompt_tokens_by_source["local_compute"] += compute
            if not p.enable_chunked_prefill:
                delay += p.ttft + compute * p.prefill_per_token
        if p.enable_chunked_prefill:
            req.prefill_left = compute
            req.ready_at = now + delay
            return
        self._seq += 1
        heapq.heappush(self._prefills, (now + delay, self._seq, req.epoch, req))

    def _complete_prefills(self, now: float, touched: list[Request]) -> None:
        heap = self._prefills
        while heap and heap[0][0] <= now:
            _, _, epoch, req = heapq.heappop(heap)
            if req.epoch != epoch or req.state is not State.RUNNING:
                continue
            self._prefill_done(req, now, touched)
        if self._decoding and self._decode_due is None:
            self._decode_due = now + self.step_duration()

    def _prefill_done(self, req: Request, now: float, touched: list[Request]) -> None:
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

    def _step_chunked(self, now: float, touched: list[Request]) -> None:
        """Finish the step in flight if due, admit, then start the next one."""
        step = self._step
        if step is not None and now >= step.due:
            self._step = None
            for req in step.decodes:
                # An earlier token of this step may have preempted it, or an abort ended it.
                if req in self._decoding:
                    self._emit(req, now, touched)
            for chunk in step.chunks:
                req = chunk.req
                if req.epoch != chunk.epoch or req.state is not State.RUNNING:
                    continue
                req.prefill_left -= chunk.tokens
                if req.prefill_left == 0:
                    self._prefill_done(req, now, touched)
        if self.waiting:
            self._admit(now)
        if self._step is None:
            self._step = batch.plan(
                self.params, now, len(self.running), self._decoding, self.running
            )

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
        req.final_blocks = req.blocks
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
            "external_prefix_cache_queries": s.external_prefix_cache_queries,
            "external_prefix_cache_hits": s.external_prefix_cache_hits,
            "prompt_tokens_by_source": dict(s.prompt_tokens_by_source),
        }
