"""One engine step under chunked prefill: which tokens share it, and how long it lasts.

By default the simulator runs each request's prefill on its own timer, beside the decode
steps, so a long prompt never slows anyone else's tokens. Real vLLM does not work that way:
its scheduler packs every decoding request's next token and chunks of waiting prompts into
one forward pass under a token budget (`--max-num-batched-tokens`), and that pass lasts as
long as its prompt tokens take to compute. A long prompt arriving therefore stretches the
inter-token latency of every running decode until its prefill is through: the interference
that prefill/decode disaggregation removes. This module plans such a step; it is pure, and
the engine runs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.simengine.engine import EngineParams, Request


@dataclass(slots=True)
class Chunk:
    req: Request
    tokens: int
    # The request's epoch when planned: a preemption in between makes the chunk void.
    epoch: int


@dataclass(slots=True)
class Step:
    due: float
    decodes: list[Request]
    chunks: list[Chunk]


def plan(
    params: EngineParams,
    now: float,
    running: int,
    decoding: Iterable[Request],
    prefilling: Iterable[Request],
) -> Step | None:
    """The step starting at `now`, or None when nothing is ready to run.

    Every decoding request gets one token; what budget is left goes to prefill chunks in
    admission order (`prefilling`), each as much of its remaining prompt as fits, as vLLM's
    scheduler fills a step. Duration: itl + itl_per_running * running + prefill tokens *
    prefill_per_token (no fixed per-request `ttft` here: a prompt costs its tokens).
    """
    decodes = list(decoding)
    budget = params.max_num_batched_tokens - len(decodes)
    chunks: list[Chunk] = []
    for req in prefilling:
        if budget <= 0:
            break
        if req.prefill_left <= 0 or req.ready_at > now:
            continue
        n = min(req.prefill_left, budget)
        chunks.append(Chunk(req, n, req.epoch))
        budget -= n
    if not decodes and not chunks:
        return None
    prefill_tokens = sum(c.tokens for c in chunks)
    duration = (
        params.itl + params.itl_per_running * running + prefill_tokens * params.prefill_per_token
    )
    return Step(now + duration, decodes, chunks)
