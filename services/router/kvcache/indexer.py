"""How much of a prompt each engine holds: tokens, block keys, index lookup.

The read side of the KV event index, in kv-cache-manager's steps (its `GetPodScores`):
tokenize the prompt as each engine kind does (`tokens`), hash its blocks as the relay
hashes the engine's (`llmgw.kvblocks`), and look them up in the `BlockIndex`. Scoring
(what a held block is worth, and when affinity gives way to load) is the scheduler's
(`scheduling.cached`): this module only says what each engine holds.

The work on one prompt is kept in its `PromptWork`, which lives as long as the request,
so a retry on another endpoint tokenizes and hashes nothing again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmgw.kvblocks import EVENTS_WITHOUT_EXTRA_KEYS, LazyPromptHashes, root_for, salt_extra
from llmgw.router.kvcache.tokens import engine_prompt, tokens_for

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.kvcache.index import BlockIndex


class PromptWork:
    """One prompt's tokens and block hashes, computed as candidates need them.

    A request for a LoRA adapter hashes its blocks from the adapter's root: the engine's
    blocks computed under an adapter match no other adapter's and not the base model's,
    and the agents' relays root them there (llmgw.kvblocks.root_for)."""

    __slots__ = ("tokens", "hashes", "held", "root", "rendered")

    def __init__(
        self,
        adapter: str | None = None,
        body: bytes = b"",
        prompt: bytes = b"",
        responses: bool = False,
    ) -> None:
        self.root = root_for(adapter)
        # What a model's tokenizer renders to make the engine's ids, None where it
        # cannot (tokens.engine_prompt); decided once.
        self.rendered = engine_prompt(body, prompt, responses)
        # Token ids by engine kind (None: that kind's tokenizer is not available).
        self.tokens: dict[str, bytes | list[int] | None] = {}
        # Lazily computed block hashes by (engine kind, block size).
        self.hashes: dict[tuple[str, int], LazyPromptHashes] = {}
        # Endpoint id -> prompt tokens its engine held at the latest lookup.
        self.held: dict[str, int] = {}


class Indexer:
    """Answers "how many of this prompt's blocks does each candidate's engine hold?"."""

    def __init__(self, index: BlockIndex, max_blocks: int = 512):
        self.index = index
        self.max_blocks = max_blocks  # prompt blocks hashed per request, at most

    def tracks(self, endpoint_id: str) -> bool:
        """The endpoint's engine sends KV events and the index is synced for it."""
        return bool(self.index.block_size(endpoint_id))

    def block_sizes(self, cands: Sequence[EndpointRuntime]) -> list[int] | None:
        """Per candidate, the block size of its engine's events (0: none); None when no
        candidate has events, so a fleet without them costs nothing more."""
        index = self.index
        if not index.endpoints:
            return None
        sizes = None
        for i, ep in enumerate(cands):
            bs = index.block_size(ep.id)
            if bs:
                if sizes is None:
                    sizes = [0] * len(cands)
                sizes[i] = bs
        return sizes

    def overlaps(
        self,
        prompt: bytes,
        salt: str | None,
        tokenizer: str,
        cands: Sequence[EndpointRuntime],
        sizes: list[int],
        work: PromptWork,
    ) -> list[tuple[int, int] | None]:
        """Per candidate: (blocks its engine holds, blocks of the prompt) from events, or
        None where events cannot tell (none; a salted prompt on an engine whose events
        carry no extra keys; no tokenizer for its kind, or none that can make the
        engine's ids: `work.rendered`).

        Hashes are computed while matching and only as far as some candidate holds the
        prompt (a cold prompt costs one small chunk)."""
        out: list[tuple[int, int] | None] = [None] * len(cands)
        tokens = work.tokens
        groups: dict[tuple[str, int], list[int]] = {}
        for i, bs in enumerate(sizes):
            if not bs:
                continue
            engine = cands[i].spec.engine
            if salt and engine in EVENTS_WITHOUT_EXTRA_KEYS:
                continue  # its events cannot tell salted blocks
            if engine not in tokens:
                tokens[engine] = tokens_for(engine, tokenizer, prompt, work.rendered)
            if tokens[engine] is not None:
                groups.setdefault((engine, bs), []).append(i)
        held = work.held
        for key, members in groups.items():
            hashes = work.hashes.get(key)
            if hashes is None:
                hashes = work.hashes[key] = LazyPromptHashes(
                    tokens[key[0]], key[1], self.max_blocks, work.root, salt_extra(salt)
                )
            n = len(hashes)
            if not n:
                for i in members:
                    out[i] = (0, 0)
                continue
            found = self.index.match(hashes, [cands[i].id for i in members])
            for i in members:
                ep_id = cands[i].id
                blocks = found.get(ep_id, 0)
                out[i] = (blocks, n)
                held[ep_id] = blocks * key[1]
        return out
