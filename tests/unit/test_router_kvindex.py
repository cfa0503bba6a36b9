"""The router's block index fed by relayed KV events, and the kv_prefix scorer over it."""

from __future__ import annotations

import msgspec
import pytest

from llmgw import contracts as c
from llmgw.contracts import Endpoint, SchedulingSpec
from llmgw.kvblocks import byte_tokens, prompt_hashes, token_bytes
from llmgw.router.endpoints.capacity import BatchCapacities
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.view import EndpointRuntime, ViewSettings
from llmgw.router.kvcache.index import BlockIndex
from llmgw.router.kvcache.indexer import Indexer
from llmgw.router.kvcache.tokens import sim_tokens
from llmgw.router.scheduling import pipeline as sc
from llmgw.router.scheduling.cached import CachedPrefixScorer, worth_their_load
from llmgw.router.scheduling.prefix import PrefixConfig, block_hashes
from llmgw.simengine.protocol import Limits, RequestParser

NOW = 1000.0
BS = 4


def batch(first, last=None, *ops, epoch="e1", shard="a"):
    return c.KvEvents(
        node="n1",
        shard_id=shard,
        epoch=epoch,
        seq_first=first,
        seq_last=first if last is None else last,
        block_size=BS,
        ops=list(ops),
    )


def stored(*hashes):
    return c.KvBlockOp(op=c.KvOp.STORED, hashes=list(hashes))


def removed(*hashes):
    return c.KvBlockOp(op=c.KvOp.REMOVED, hashes=list(hashes))


def snap(seq, *hashes, epoch="e1", shard="a"):
    return c.KvSnapshot(
        node="n1", shard_id=shard, epoch=epoch, seq=seq, block_size=BS, hashes=list(hashes)
    )


def synced(index, shard="a", *hashes, seq=0):
    assert index.offer(shard, batch(seq, shard=shard))  # first batch: snapshot needed
    assert not index.snapshot(shard, snap(seq, *hashes, shard=shard))


def test_match_counts_leading_blocks_held_per_endpoint():
    index = BlockIndex()
    synced(index, "a", 1, 2, 3)
    synced(index, "b", 1, 2)
    synced(index, "c", 2, 3)  # holds later blocks but not the first: no prefix
    assert index.match([1, 2, 3, 4], ["a", "b", "c", "unsynced"]) == {"a": 3, "b": 2, "c": 0}
    assert index.match([], ["a"]) == {"a": 0}


def test_batches_apply_in_order_and_a_gap_asks_for_a_snapshot_then_replays():
    index = BlockIndex()
    assert index.offer("a", batch(5, 5, stored(1)))
    assert not index.has_events("a")
    # Arrives while the snapshot is awaited: kept for the replay.
    assert not index.offer("a", batch(6, 7, stored(2), removed(1)))
    assert not index.snapshot("a", snap(5, 1))
    assert index.has_events("a")
    assert index.match([1], ["a"]) == {"a": 0}  # removed by the replayed batch
    assert index.match([2], ["a"]) == {"a": 1}
    assert not index.offer("a", batch(7, 7, stored(99)))  # already applied: ignored
    assert index.match([99], ["a"]) == {"a": 0}
    assert not index.offer("a", batch(8, 8, stored(3)))
    assert index.match([2], ["a"]) == {"a": 1} and index.match([3], ["a"]) == {"a": 1}
    # A lost batch (9) and a new epoch both resync.
    assert index.offer("a", batch(10, 10, stored(4)))
    assert index.gaps == 1
    assert not index.snapshot("a", snap(10, 2, 3, 4))
    assert index.offer("a", batch(0, 0, stored(5), epoch="e2"))


def test_a_failed_snapshot_keeps_what_arrived_for_the_next_try():
    index = BlockIndex()
    synced(index, "a", 1, seq=4)
    assert index.offer("a", batch(6, 6, stored(2)))  # 5 was lost: resync
    index.snapshot_failed("a")  # the agent did not answer in time
    assert not index.has_events("a") and index.match([1], ["a"]) == {}
    # Still resyncing: what arrives waits for the feed's next try, which replays it.
    assert not index.offer("a", batch(7, 7, stored(3), removed(1)))
    assert not index.snapshot("a", snap(5, 1))
    assert index.match([1], ["a"]) == {"a": 0}  # evicted by batch 7
    assert index.match([2], ["a"]) == {"a": 1} and index.match([3], ["a"]) == {"a": 1}


def test_a_replay_that_finds_a_gap_asks_again():
    index = BlockIndex()
    index.offer("a", batch(1))
    index.offer("a", batch(4, 4, stored(7)))
    assert index.snapshot("a", snap(2))  # 3 is missing between the snapshot and 4


def test_dropping_an_endpoint_removes_its_blocks_and_reuses_its_slot():
    index = BlockIndex()
    synced(index, "a", 1, 2)
    synced(index, "b", 2, 3)
    index.drop("a")
    assert index.match([2], ["b"]) == {"b": 1}
    # a's slot is retired at once; its bits go in bounded sweeps, then the slot is reused.
    assert index.needs_sweep
    swept = [index.sweep(budget=1) for _ in range(3)]
    assert swept == [False, False, True] and not index.needs_sweep
    assert 1 not in index.blocks and index.blocks[2] == 1 << index.endpoints["b"].slot
    synced(index, "c", 9)
    assert index.endpoints["c"].slot == 0  # a's slot, with none of a's blocks
    assert index.match([1, 2], ["c"]) == {"c": 0}
    index.snapshot_failed("b")
    assert not index.has_events("b") and index.match([2], ["b"]) == {}


def test_a_snapshot_replaces_blocks_at_once_and_the_sweep_catches_up():
    index = BlockIndex()
    synced(index, "a", 1, 2, 3)
    synced(index, "b", 2)
    assert index.offer("a", batch(5))  # a gap
    assert not index.snapshot("a", snap(5, 3, 4))
    assert index.match([1], ["a"]) == {"a": 0} and index.match([3], ["a"]) == {"a": 1}
    assert index.match([2], ["a", "b"]) == {"a": 0, "b": 1}
    # A clear inside a batch takes effect for the rest of the batch too.
    cleared = c.KvBlockOp(op=c.KvOp.CLEARED)
    assert not index.offer("a", batch(6, 6, stored(7), cleared, stored(8)))
    assert index.match([7], ["a"]) == {"a": 0} and index.match([8], ["a"]) == {"a": 1}
    while not index.sweep(budget=2):
        pass
    assert set(index.blocks) == {2, 8}


def test_memory_is_bounded_by_max_blocks():
    index = BlockIndex(max_blocks=3)
    synced(index, "a", 1, 2, 3, 4, 5)
    assert len(index) == 3 and index.dropped_stores == 2


# ------------------------------------------------------------------ the scorer


def endpoint(name, engine="sim", waiting=0, max_running=None):
    e = EndpointRuntime(
        Endpoint(id=name, url=f"http://{name}", engine=engine, max_running=max_running),
        ViewSettings(),
    )
    e.models = frozenset({"m"})
    e.load = Load(waiting=waiting, running=0, kv_usage=0.0, at=NOW)
    return e


def chat(*contents: str) -> bytes:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return msgspec.json.encode(
        [{"role": r, "content": t} for r, t in zip(roles, contents, strict=False)]
    )


def context(messages: bytes, key=0):
    return sc.Context(NOW, "m", prefix=block_hashes(messages, 256, 128), key=key)


def sim_blocks(messages: bytes) -> list[int]:
    return prompt_hashes(sim_tokens(messages), BS, 10_000)


def test_the_router_tokenizes_a_chat_exactly_as_the_simulator_does():
    messages = chat("You are terse. " * 10, "hello", "hi", "and again")
    body = b'{"model":"m","messages":' + messages + b"}"
    job = RequestParser(Limits(frozenset({"m"}), 100_000, "lorem", 16)).chat(body)
    assert sim_tokens(messages) == token_bytes(byte_tokens(job.prompt))
    assert sim_tokens(b'"plain prompt"') == token_bytes(byte_tokens(b"plain prompt"))
    assert sim_tokens(b"[1, 2, 3]") == token_bytes([1, 2, 3])
    # Hashing the bytes or the ids is the same.
    ids = byte_tokens(job.prompt)
    assert prompt_hashes(ids, BS, 99) == prompt_hashes(token_bytes(ids), BS, 99)
    assert sim_tokens(b"[{bad json") is None


def pipeline(index, batches=None, **prefix):
    spec = SchedulingSpec(scorers={"kv_prefix": 3, "queue": 1, "inflight": 1})
    indexer = None if index is None else Indexer(index)
    settings = sc.Settings(
        stale_after=1.0, indexer=indexer, batches=batches, prefix=PrefixConfig(**prefix)
    )
    return sc.Pipeline(spec, settings)


def test_the_engine_holding_the_prefix_wins_and_two_pipelines_agree():
    system = "You are a careful assistant. " * 20
    turn1 = chat(system, "question one")
    index = BlockIndex()
    synced(index, "b", *sim_blocks(turn1))
    synced(index, "a")
    synced(index, "c")
    eps = [endpoint("a"), endpoint("b"), endpoint("c")]
    turn2 = chat(system, "question one", "answer", "question two")
    picks = set()
    for _ in range(2):  # a second router: same index contents, same inputs, same pick
        p = pipeline(index)
        picks.add(p.pick(eps, context(turn2, key=1)).id)
    assert picks == {"b"}
    # Without a shared system prompt the load decides (b is now the busiest).
    eps[1].inflight = 3
    assert pipeline(index).pick(eps, context(chat("other", "x" * 600), key=1)).id != "b"


def test_a_busy_warm_engine_loses_its_affinity():
    system = "You are a careful assistant. " * 20
    turn1 = chat(system, "q")
    index = BlockIndex()
    synced(index, "warm", *sim_blocks(turn1))
    synced(index, "cold")
    cold, warm = endpoint("cold"), endpoint("warm", waiting=5)
    # The absolute limit alone (the relative one, off here, has tests of its own).
    absolute = {"affinity_max_pending": 4, "affinity_tokens_per_request": 0}
    assert pipeline(index, **absolute).pick([cold, warm], context(turn1)).id == "cold"
    warm.load = Load(waiting=4, running=0, kv_usage=0.0, at=NOW)
    assert pipeline(index, **absolute).pick([cold, warm], context(turn1)).id == "warm"
    # In flight from this router beyond the engine's capacity counts as pending too.
    warm.load = None
    warm.spec = Endpoint(id="warm", url="http://warm", engine="sim", max_running=2)
    warm.inflight = 7
    assert pipeline(index, **absolute).pick([cold, warm], context(turn1)).id == "cold"


def test_endpoints_without_events_fall_back_to_the_approximate_guess():
    system = "You are a careful assistant. " * 20
    turn1 = chat(system, "q")
    index = BlockIndex()
    quiet_a, quiet_b = endpoint("qa", engine="sglang"), endpoint("qb", engine="sglang")
    p = pipeline(index)
    first = p.pick([quiet_a, quiet_b], context(turn1, key=1))
    # The approximate guess remembers where this router sent the prefix.
    again = pipeline(index).pick([quiet_a, quiet_b], context(chat(system, "q2"), key=2))
    # A fresh pipeline shares the per-endpoint LRU (it lives on the endpoint).
    assert again.id == first.id
    # With no index at all (router-only mode) the scorer is the approximate one.
    assert pipeline(None).pick([quiet_a, quiet_b], context(turn1, key=5)).id == first.id


def test_the_scorer_hashes_only_as_far_as_an_engine_holds_the_prompt_and_once_per_request():
    system = "You are a careful assistant. " * 40
    warm_prompt = chat(system, "q")
    index = BlockIndex()
    held = sim_blocks(warm_prompt)
    synced(index, "a", *held)
    synced(index, "b")
    eps = [endpoint("a"), endpoint("b")]
    p = pipeline(index)
    # A cold prompt: one small first chunk hashed, not its hundreds of blocks, and
    # none of the approximate hashes.
    cold = context(chat("Something else entirely. " * 40, "q"))
    assert p.pick(eps, cold) is not None
    assert len(cold.kv.hashes[("sim", BS)]._done) <= 4 < len(cold.kv.hashes[("sim", BS)])
    assert cold.prefix._hashes is None
    # A warm prompt: hashed up to the first block no engine holds, kept for a retry.
    warm = context(chat(system, "q", "a long answer. " * 300, "q2"))
    assert p.pick(eps, warm).id == "a"
    lazy = warm.kv.hashes[("sim", BS)]
    hashed = len(lazy._done)
    # (in chunks of 4, 16, 64, 256 blocks: as far as the chunk the first miss is in)
    assert len(held) - 1 <= hashed < len(lazy)
    warm.exclude = ["a"]
    p.pick(eps, warm)  # the retry
    assert warm.kv.hashes[("sim", BS)] is lazy and len(lazy._done) == hashed
    assert warm.prefix._hashes is None


def test_no_endpoint_with_events_means_no_precise_work():
    index = BlockIndex()
    scorer = CachedPrefixScorer(sc.Settings(indexer=Indexer(index)))
    ctx = context(chat("sys " * 200, "q"))
    assert scorer.overlaps([endpoint("x"), endpoint("y")], ctx) is None
    assert ctx.kv is None


def test_a_learned_batch_capacity_limits_a_burst_when_the_load_sample_is_stale():
    system = "You are a careful assistant. " * 20
    turn1 = chat(system, "q")
    index = BlockIndex()
    synced(index, "warm", *sim_blocks(turn1))
    synced(index, "cold")
    cold, warm = endpoint("cold"), endpoint("warm")
    batches = BatchCapacities()
    p = pipeline(index, affinity_max_pending=4, affinity_tokens_per_request=0, batches=batches)
    # A sample from when the engine was full: 8 running, 2 queued. It is stale now.
    warm.load = Load(waiting=2, running=8, kv_usage=0.5, at=NOW - 5)
    batches.observed(warm)  # as the view tells it when the sample lands
    warm.inflight = 8 + 4
    assert p.pick([cold, warm], context(turn1)).id == "warm"  # 4 beyond: at the limit
    warm.inflight = 8 + 5  # this router's burst: 5 beyond the learned capacity
    assert p.pick([cold, warm], context(turn1)).id == "cold"


def test_events_and_matches_during_a_sweep_see_one_consistent_index():
    index = BlockIndex()
    synced(index, "a", *range(1, 101))
    synced(index, "b", *range(1, 51))
    assert index.offer("a", batch(5))  # a gap: a's old blocks are retired, then swept
    assert not index.snapshot("a", snap(5, *range(1, 11)))
    assert not index.sweep(budget=10)  # ten entries moved back, the rest still set aside
    assert index.match(list(range(1, 101)), ["a", "b"]) == {"a": 10, "b": 50}
    # Writes during the sweep: a removal, a store, on entries it has not reached yet.
    assert not index.offer("b", batch(1, 1, removed(3), stored(60)))
    assert not index.offer("a", batch(6, 6, stored(11)))
    assert index.match(list(range(1, 101)), ["a", "b"]) == {"a": 11, "b": 2}
    while not index.sweep(budget=7):
        pass
    a, b = 1 << index.endpoints["a"].slot, 1 << index.endpoints["b"].slot
    assert {h for h, m in index.blocks.items() if m & a} == set(range(1, 12))
    assert {h for h, m in index.blocks.items() if m & b} == set(range(1, 51)) - {3} | {60}
    assert len(index) == 51  # 1..50 but 3, then 11 (a) and 60 (b): nothing stale left


def test_affinity_gives_way_to_uncached_prefill_queued_at_the_warm_engine():
    system = "You are a careful assistant. " * 20
    turn1 = chat(system, "q")
    index = BlockIndex()
    synced(index, "warm", *sim_blocks(turn1))
    synced(index, "cold")
    cold, warm = endpoint("cold"), endpoint("warm", waiting=3)  # 3 pending: under 4
    p = pipeline(
        index,
        affinity_max_pending=4,
        affinity_max_pending_tokens=8192,
        affinity_tokens_per_request=0,  # the absolute limits alone
    )
    warm.uncached_tokens = 100.0  # short uncached tails: 300 tokens queued
    assert p.pick([cold, warm], context(turn1)).id == "warm"
    warm.uncached_tokens = 3000.0  # long cold prompts queued: 9000 tokens of prefill
    assert p.pick([cold, warm], context(turn1)).id == "cold"
    # With the token limit off, only the request count counts.
    no_token_limit = pipeline(index, affinity_max_pending_tokens=0, affinity_tokens_per_request=0)
    assert no_token_limit.pick([cold, warm], context(turn1)).id == "warm"


def test_each_pick_feeds_the_endpoints_average_of_uncached_tokens():
    system = "You are a careful assistant. " * 20
    turn1 = chat(system, "q")
    index = BlockIndex()
    held = sim_blocks(turn1)
    synced(index, "warm", *held)
    synced(index, "cold")
    warm = endpoint("warm")
    p = pipeline(index)
    long_tail = chat(system, "q", "an answer " * 100, "next")
    assert p.pick([endpoint("cold"), warm], context(long_tail)).id == "warm"
    uncached = len(sim_tokens(long_tail)) // 4 - len(held) * BS
    assert warm.uncached_tokens == pytest.approx(0.2 * uncached)


# ------------------------------------------------------------------ cache vs load


def test_a_cache_counts_only_where_it_pays_for_the_requests_in_front():
    # Idle and cold vs three requests and 300 tokens held: three requests cost more.
    assert worth_their_load([3, 0], [300.0, 0.0], 512) == [False, True]
    # 2,000 tokens held pay for them (1,536 tokens' worth of waiting).
    assert worth_their_load([3, 0], [2000.0, 0.0], 512) == [True, False]
    # Equally loaded: the caches alone tell them apart, and equal ones tie.
    assert worth_their_load([2, 2], [100.0, 50.0], 512) == [True, False]
    assert worth_their_load([1, 1], [0.0, 0.0], 512) == [True, True]
    # The least-loaded candidate holding the prompt too needs no cache elsewhere.
    assert worth_their_load([4, 0, 1], [3000.0, 3000.0, 0.0], 512) == [False, True, False]


def default_pipeline(index):
    """The catalog's default scheduling (inflight, kv_prefix) on this index."""
    return sc.Pipeline(SchedulingSpec(), sc.Settings(stale_after=1.0, indexer=Indexer(index)))


def warm_and_cold(prompt: bytes):
    index = BlockIndex()
    synced(index, "warm", *sim_blocks(prompt))
    synced(index, "cold")
    return index, endpoint("cold"), endpoint("warm")


def test_the_default_sends_a_short_shared_prefix_to_the_idle_engine_not_the_busy_warm_one():
    # A fleet where nothing evicts: the warm engine's ~150 cached tokens save less
    # prefill than waiting behind its two requests costs (2 x 128), so the idle engine
    # gets it; they pay for one (a conversation's next turn keeps its engine).
    turn1 = chat("You are a careful assistant. " * 20, "q")
    index, cold, warm = warm_and_cold(turn1)
    p = default_pipeline(index)
    warm.inflight = 1
    assert p.pick([cold, warm], context(turn1)).id == "warm"
    warm.inflight = 2
    assert p.pick([cold, warm], context(turn1)).id == "cold"
    # Equally loaded, the cache decides.
    cold.inflight = 2
    assert p.pick([cold, warm], context(turn1)).id == "warm"


def test_the_default_keeps_a_long_prefix_on_its_warm_engine_despite_a_few_requests_more():
    # ~3,000 tokens held pay for ten requests more (1,280 tokens' worth at 128 each).
    turn1 = chat("You are a careful assistant. " * 400, "q")
    index, cold, warm = warm_and_cold(turn1)
    p = default_pipeline(index)
    warm.inflight = 10
    assert p.pick([cold, warm], context(turn1)).id == "warm"
    # ... but not for thirty.
    warm.inflight = 30
    assert p.pick([cold, warm], context(turn1)).id == "cold"


def test_uncached_prefill_queued_at_the_warm_engine_counts_against_its_cache():
    # Equally loaded, 300 tokens held against none: the warm engine wins ...
    assert worth_their_load([2, 2], [300.0, 0.0], 128, [0.0, 0.0]) == [True, False]
    # ... until its queued prefill (two of this router's requests before their first
    # token, 250 uncached tokens each) costs more than its cache saves.
    assert worth_their_load([2, 2], [300.0, 0.0], 128, [500.0, 0.0]) == [False, True]
    assert worth_their_load([2, 2], [300.0, 0.0], 128, [200.0, 0.0]) == [True, False]


def test_the_default_sends_a_turn_away_from_a_warm_engine_busy_with_prefills():
    # A closed loop's burst: several clients finished on the warm engine at once and
    # their next turns wait for their first token there. Its ~150 cached tokens pay for
    # one request more in flight (128); what they do not pay for is those prefills.
    turn1 = chat("You are a careful assistant. " * 20, "q")
    index, cold, warm = warm_and_cold(turn1)
    p = default_pipeline(index)
    cold.inflight, warm.inflight = 2, 3
    warm.uncached_tokens = 400.0
    assert p.pick([cold, warm], context(turn1)).id == "warm"
    warm.prefilling = 2  # 800 uncached tokens queued, weighed at half: 400
    assert p.pick([cold, warm], context(turn1)).id == "cold"
    # Off, the in-flight counts and caches alone decide.
    off = sc.Pipeline(
        SchedulingSpec(),
        sc.Settings(
            stale_after=1.0,
            indexer=Indexer(index),
            prefix=PrefixConfig(affinity_queued_prefill=0),
        ),
    )
    assert off.pick([cold, warm], context(turn1)).id == "warm"


def test_the_load_weighed_is_this_routers_in_flight_not_a_shared_sample():
    turn1 = chat("You are a careful assistant. " * 20, "q")
    index, cold, warm = warm_and_cold(turn1)
    p = default_pipeline(index)
    warm.inflight = 2
    assert p.pick([cold, warm], context(turn1)).id == "cold"
    # A sample's batch, which every router reads alike until the next one, is not it:
    # weighed, it would send every router's requests to the engine it shows idle.
    warm.inflight = 0
    warm.load = Load(waiting=0, running=3, kv_usage=0.0, at=NOW)
    assert p.pick([cold, warm], context(turn1)).id == "warm"


def test_the_approximate_guess_weighs_its_cache_against_load_too():
    # Engines without events: the guess's matched 256-byte blocks count 64 tokens each.
    system = "You are a careful assistant. " * 20
    quiet_a, quiet_b = endpoint("qa", engine="sglang"), endpoint("qb", engine="sglang")
    p = default_pipeline(BlockIndex())
    first = p.pick([quiet_a, quiet_b], context(chat(system, "q"), key=1))
    other = quiet_b if first is quiet_a else quiet_a
    assert p.pick([quiet_a, quiet_b], context(chat(system, "q2"), key=2)) is first
    first.inflight = 2
    assert p.pick([quiet_a, quiet_b], context(chat(system, "q3"), key=3)) is other
