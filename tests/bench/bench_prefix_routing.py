"""Prefix-aware routing on a multi-turn, multi-tenant chat load: four policies per regime.

    .venv/bin/python tests/bench/bench_prefix_routing.py [--seconds 30] [--clients 24]

Four simulated engines publish KV events to the agent's relay (llmgw.agent.kvrelay) on
a real nats-server, in two regimes (`--sim-kv-blocks`): caches small enough to evict
(640 blocks: each holds a few tenants' system prompts, the fleet holds them all) and
caches where nothing evicts (65,536 blocks). Clients run conversations (a tenant's long
system prompt, then turns that each extend the previous prompt with the answer and a
new question), streaming, closed loop (or paced, `--rate`), alternating requests
between two router instances (a round-robin split). Each policy runs on fresh engines, the policies
interleaved, `--repeat` rounds (2) of them:

  round_robin   two vllm-router instances, --policy round_robin
  least_inflight  two llmgw routers, each sending a request where it has the fewest
                in flight: round robin's balance at the llmgw routers' CPU cost (on a
                loaded 2-core machine the Python routers' queueing dominates TTFT, so
                this, not vllm-router, shows what the default's decisions cost)
  approximate   two llmgw routers, the default weights with the old approximate
                `prefix` scorer in place of `kv_prefix`
  default       two llmgw routers, the default scheduling (contracts.SchedulingSpec):
                the `kv_prefix` scorer over relayed KV events, weighed against load
  cache_aware   two vllm-router instances, --policy cache_aware (PyPI vllm-router
                0.1.17 in its own venv: $VLLM_ROUTER, default
                /root/.cache/llmgw/vllm-router-venv/bin/vllm-router)

and, named in `--policies`: `random_key` (below), `random` and `power_of_two` (two
vllm-router instances with that policy), `default@N` and `scorers:...`.

Printed per regime, each run and then every run pooled: mean and p90 TTFT,
throughput, the fleet's prefix cache hit rate (from the engines' /metrics counters),
and the oracle's hit rate: at each request's dispatch, the longest cached prefix any
engine holds (from the relayed engine state). Also the router index's memory per
million blocks.

Targets, PASS or FAIL per regime on the pooled runs: the default's mean TTFT at most 5%
above round robin's; on the sims also the default's hit rate within 5 points of its
oracle, and on the evicting sims its mean TTFT at least 30% below cache_aware's (without
vllm-router, the comparisons with it are skipped). Each round runs the policies one
place later than the last (round 2 starts with the second), so neither a warming engine
nor a drift of the machine's speed falls on one policy. Under the round robin line, the
gap over the rounds with a 90% interval (Student's t over the rounds' paired ratios)
says whether the rounds settle the target: on two cores one run's mean moves by tens of
percent from round to round, so a pooled gap of a few percent is often chance (then:
more rounds, `--repeat`).

    .venv/bin/python tests/bench/bench_prefix_routing.py --vllm-python V/bin/python \
        [--vllm-model DIR] [--seconds 20] [--vllm-kv-blocks 0,96]

runs the same comparison on two real vLLM CPU engines, in two regimes
(`--vllm-kv-blocks`): vLLM's default cache (nothing evicts) and 96 blocks per engine
(--num-gpu-blocks-override: shared prefixes and earlier turns evict). The tiny random
Llama in DIR (default: built by llmgw.dev.tinymodel under ~/.cache/llmgw/models),
completions requests (a chat would need jinja2 in the router's environment to render
the template), the routers hashing prompts with the model's own tokenizer
(`scheduling.tokenizer`), the prefix cache reset between policies (vLLM's dev-mode
/reset_prefix_cache, which also exercises AllBlocksCleared), after one unmeasured run
of the first policy (a fresh engine's first batches are slower). Its targets: the default
within 5% of round robin's mean TTFT, and KV events flowing from vLLM to the routers.
`--tokens-per-request N` sets the routers' `prefix.affinity_tokens_per_request` (the
rule's rate) for every llmgw policy; the policy `default@N` runs the default with
the rate N, to measure others beside it, and `default@N/FIELD=VALUE/...` sets other
`prefix:` fields too (`default@128/affinity_queued_prefill=0`: the rule without the
queued prefill); N given there wins over `--tokens-per-request`.

`--pin` (on by default in the real-vLLM mode, `--no-pin` turns it off; off by default
on the sims) keeps router CPU away from engine compute, as on a real fleet where
routers run on hosts of their own: this process (the load generator, the NATS server
and the relays), every router (llmgw's and vllm-router alike, which inherit its CPU)
run on CPU 0, the engines on CPU 1 (`taskset`, and vLLM's OpenMP threads bound there by
VLLM_CPU_OMP_THREADS_BIND). Unpinned, two Python routers, the engines and the load
generator share both cores, and the comparison with the Rust vllm-router partly
measures router CPU rather than routing.

`--rate R` paces the clients: at most R request starts a second over all of them. The
closed loop (the default) sends a policy that answers sooner more requests, so its TTFT
is measured at a higher load than a slower policy's; paced below every policy's
capacity, each serves the same requests a second, and mean TTFTs compare at equal load.

`random_key` is two llmgw routers with no scorers: every candidate ties, so requests
spread without looking at load or caches, at the llmgw routers' own cost. Its name is
from when max_score broke ties by the request key (a random split); they now go in
turn, so it is round robin in llmgw's routers. vllm-router's `random` policy (also
`power_of_two`) can run beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _router_bench import cpu_seconds  # noqa: E402

from llmgw import bus, projection, subjects
from llmgw import contracts as c
from llmgw.agent import kvsockets
from llmgw.agent.kvrelay import EngineRelay, KvRelays
from llmgw.agent.launch import LaunchContext, kv_events_args
from llmgw.agent.metrics import parse_load
from llmgw.dev import servers as localservers
from llmgw.dev.routerkit import start_router
from llmgw.dev.simkit import start_sim
from llmgw.kvblocks import prompt_hashes, token_count
from llmgw.router.kvcache.index import BlockIndex
from llmgw.router.kvcache.tokens import sim_tokens

MODEL = "m"
NODE = "bench"
BLOCK = 16
VLLM_ROUTER = os.environ.get("VLLM_ROUTER", "/root/.cache/llmgw/vllm-router-venv/bin/vllm-router")
HAVE_VLLM_ROUTER = os.path.exists(VLLM_ROUTER)
# Policies run by two vllm-router instances (`random`: its random split of the requests).
VLLM_ROUTER_POLICIES = ("round_robin", "cache_aware", "random", "power_of_two")
SIM = dict(
    model=MODEL,
    block_size=BLOCK,
    max_model_len=8192,
    max_num_seqs=6,
    ttft_ms=10,
    prefill_ms_per_token=0.25,
    itl_ms=10,
    itl_ms_per_running=1,
    default_output_tokens=16,
)
TENANTS = 10
SYSTEM_WORDS = 1100  # ~1,500 simulator tokens each
QUESTION_WORDS = 40
TURNS = (3, 7)
TARGET_ORACLE_GAP = 0.05
TARGET_TTFT_CUT = 0.30
TARGET_VS_ROUND_ROBIN = 0.05  # the default's mean TTFT at most this much above round robin's
# The sims' KV cache: 640 blocks hold ~4 tenants' system prompts with their live
# conversations (the fleet of 4 holds them all, each engine evicts); 65,536 hold every
# conversation of a run (nothing evicts).
SIM_KV_BLOCKS = "640,65536"
EVICTING_SIM_BLOCKS = 640
# Real vLLM (block size 128 on CPU, prompts up to 1,024 tokens): the default 1 GiB cache
# never fills in a run; 96 blocks hold the ~12 live conversations per engine and little
# more, so shared prefixes and earlier turns evict.
VLLM_KV_BLOCKS = "0,96"
# With --pin: where the routers and the load generator run, and where the engines do.
ROUTER_CPU = 0
ENGINE_CPU = 1


def system_prompt(tenant: int) -> str:
    rng = random.Random(tenant)
    words = [f"w{rng.randrange(10_000)}" for _ in range(SYSTEM_WORDS)]
    return f"You are the assistant of tenant {tenant}. Policies follow. " + " ".join(words)


class Pacer:
    """At most `rate` request starts a second across every client, evenly spaced (0: no
    limit, a closed loop). Closed, a policy that answers sooner is sent more requests
    and measured at a higher load; paced below every policy's capacity, each serves the
    same requests a second and their TTFTs compare at equal load."""

    def __init__(self, rate: float):
        self.gap = 1.0 / rate if rate > 0 else 0.0
        self.next = 0.0

    async def wait(self) -> None:
        if not self.gap:
            return
        now = time.monotonic()
        slot = max(now, self.next)
        self.next = slot + self.gap
        if slot > now:
            await asyncio.sleep(slot - now)


@dataclass
class Result:
    name: str
    run: int = 0  # which round of the policies (they are interleaved: one of each per round)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    hit_rate: float = 0.0
    oracle: float = 0.0
    router_cpu: float = 0.0  # CPU seconds the two routers spent in the run (every process)
    note: str = ""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.ttfts) if self.ttfts else float("nan")

    @property
    def p90(self) -> float:
        if len(self.ttfts) < 10:
            return float("nan")
        return statistics.quantiles(self.ttfts, n=10)[-1]

    @property
    def throughput(self) -> float:
        return len(self.ttfts) / self.seconds if self.seconds else 0.0

    @property
    def cpu_per_request(self) -> float:
        """The routers' CPU seconds per request answered."""
        return self.router_cpu / len(self.ttfts) if self.ttfts else float("nan")


def relay_flag(relay: EngineRelay) -> str:
    ctx = LaunchContext(
        port=1, gpu_indices=[], bind_host="", command=[],
        kv_events_endpoint=relay.endpoint, kv_replay_endpoint=relay.replay_endpoint,
    )  # fmt: skip
    return kv_events_args(ctx)[1]


def engine_counters(sims) -> tuple[float, float]:
    hits = queries = 0.0
    for sim in sims:
        for line in sim.metrics_text().splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


class Oracle:
    """The best hit any engine could give each request, from the relays' block sets."""

    def __init__(self, relays: KvRelays, tokenize=sim_tokens, completions: bool = False):
        self.relays = relays
        self.tokenize = tokenize
        self.completions = completions
        self.best = 0
        self.total = 0

    def observe(self, prompt_json: bytes) -> None:
        tokens = self.tokenize(prompt_json) or []
        count = token_count(tokens)
        bs = next((r.blocks.block_size for r in self.relays.relays.values()), 0) or BLOCK
        usable = (count - 1) // bs
        hashes = prompt_hashes(tokens, bs, usable)
        best = 0
        for relay in self.relays.relays.values():
            held = set(relay.blocks.canon.values())
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            best = max(best, n)
        self.best += best * bs
        self.total += count


async def client(
    urls: list[str],
    counter: list[int],
    stop_at: float,
    result: Result,
    oracle: Oracle,
    rng: random.Random,
    session: aiohttp.ClientSession,
    pacer: Pacer,
) -> None:
    import msgspec

    while time.monotonic() < stop_at:
        tenant = rng.randrange(TENANTS)
        messages = [{"role": "system", "content": system_prompt(tenant)}]
        for turn in range(rng.randint(*TURNS)):
            if time.monotonic() >= stop_at:
                return
            question = f"Question {turn} from user {rng.randrange(10**9)}: " + " ".join(
                f"q{rng.randrange(1000)}" for _ in range(QUESTION_WORDS)
            )
            messages.append({"role": "user", "content": question})
            await pacer.wait()
            if time.monotonic() >= stop_at:
                return
            url = urls[counter[0] % len(urls)]
            counter[0] += 1
            if oracle.completions:
                prompt = "\n".join(m["content"] for m in messages)
                path = "/v1/completions"
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}
                oracle.observe(msgspec.json.encode(prompt))
            else:
                path = "/v1/chat/completions"
                body = {"model": MODEL, "messages": messages, "max_tokens": 16, "stream": True}
                oracle.observe(msgspec.json.encode(messages))
            began = time.monotonic()
            first = None
            text = []
            try:
                async with session.post(url + path, json=body) as resp:
                    if resp.status != 200:
                        result.errors += 1
                        await resp.read()
                        break
                    async for line in resp.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        chunk = msgspec.json.decode(line[6:])
                        for ch in chunk.get("choices", []):
                            piece = (ch.get("delta") or {}).get("content") or ch.get("text")
                            if piece:
                                if first is None:
                                    first = time.monotonic() - began
                                text.append(piece)
            except (aiohttp.ClientError, TimeoutError):
                result.errors += 1
                break
            if first is not None:
                result.ttfts.append(first)
            messages.append({"role": "assistant", "content": "".join(text)})


async def drive(urls, seconds, clients, relays, name, oracle=None, rate=0.0) -> Result:
    result = Result(name)
    oracle = oracle or Oracle(relays)
    pacer = Pacer(rate)
    counter = [0]
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        began = time.monotonic()
        stop_at = began + seconds
        await asyncio.gather(
            *(
                client(urls, counter, stop_at, result, oracle, random.Random(i), session, pacer)
                for i in range(clients)
            )
        )
        result.seconds = time.monotonic() - began
    result.oracle = oracle.best / oracle.total if oracle.total else 0.0
    return result


@contextlib.asynccontextmanager
async def engines(nats_url: str, kv_blocks: int, pin: bool):
    nc = await bus.connect(nats_url, name=f"agent-{NODE}")
    sockets = kvsockets.prepare(Path(tempfile.mkdtemp(prefix="kv")) / kvsockets.DIR_NAME)
    relays = KvRelays(NODE, sockets)
    await relays.attach(nc)
    sims = []
    try:
        for i in range(4):
            relay = relays.open(f"e{i}")
            config = {**SIM, "kv_blocks": kv_blocks}
            wrapper = ["taskset", "-c", str(ENGINE_CPU)] if pin else []
            sim = await asyncio.to_thread(
                start_sim, kv_events_config=relay_flag(relay), wrapper=wrapper, **config
            )
            relay.url = sim.url
            sims.append(sim)
        async with agent_load_samples(nc, {f"e{i}": sim.url for i, sim in enumerate(sims)}):
            yield relays, sims
    finally:
        for sim in sims:
            await asyncio.to_thread(sim.stop)
        await relays.stop()
        await bus.close_quietly(nc)


@contextlib.asynccontextmanager
async def agent_load_samples(nc, engines: dict[str, str]):
    """Publish each engine's load a few times a second as its agent would (`llmgw.load.*`):
    the routers then read those samples instead of each scraping every engine's /metrics,
    as in a deployment. `engines`: shard id -> url. The task is cancelled on the way out."""
    interval = 0.25  # the agent's load_interval_seconds

    async def one(http: httpx.AsyncClient, shard: str, url: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            resp = await http.get(url + "/metrics", timeout=max(interval, 0.5))
            load = parse_load(resp.text) if resp.status_code == 200 else None
            if load is not None:
                sample = c.LoadSample(
                    node=NODE, shard_id=shard, model=MODEL, url=url, waiting=load.waiting,
                    running=load.running, kv_usage=load.kv_usage,
                )  # fmt: skip
                await nc.publish(subjects.load(NODE), c.encode(sample))

    async def loop() -> None:
        async with httpx.AsyncClient() as http:
            while True:
                started = time.monotonic()
                await asyncio.gather(*(one(http, s, u) for s, u in engines.items()))
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def vllm_routers(policy: str, sims, directory: Path) -> list[subprocess.Popen]:
    procs = []
    for _ in range(2):
        port = localservers.free_port()
        log = open(directory / f"vllm-router-{port}.log", "wb")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [
                    VLLM_ROUTER,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--policy",
                    policy,
                    "--log-level",
                    "warning",
                    "--prometheus-port",
                    str(localservers.free_port()),
                    "--worker-urls",
                    *[s.url for s in sims],
                ],  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        procs[-1].url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    for p in procs:
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {p.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(p.url + "/health", timeout=1).status_code == 200:  # type: ignore[attr-defined]
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("vllm-router did not become healthy")
            time.sleep(0.1)
    return procs


def llmgw_spec(name: str, args, tokenizer: str = "") -> c.SchedulingSpec:
    """`default`: the catalog's default scheduling; `approximate`: the same with the old
    approximate `prefix` scorer in place of `kv_prefix`; `scorers:queue=2/inflight=1`:
    the default with those scorers and weights instead (to measure alternatives)."""
    spec = c.SchedulingSpec(tokenizer=tokenizer)
    scorers = dict(spec.scorers)
    if name == "least_inflight":
        scorers = {"inflight": 1.0}
    elif name == "random_key":
        scorers = {}
    elif name.startswith("scorers:"):
        pairs = (item.split("=") for item in name.removeprefix("scorers:").split("/"))
        scorers = {scorer: float(weight) for scorer, weight in pairs}
    if args.kv_weight is not None and name != "random_key":  # oblivious stays oblivious
        scorers["kv_prefix"] = args.kv_weight
    if name == "approximate":
        scorers["prefix"] = scorers.pop("kv_prefix")
    spec.scorers = scorers
    return spec


async def start_llmgw(name, args, endpoints, js, nats_url, directory, tokenizer=""):
    """Two llmgw routers serving MODEL on `endpoints` with the policy's scheduling."""
    rec = c.ModelEndpoints(
        model=MODEL,
        endpoints=endpoints,
        scheduling=llmgw_spec(name.partition("@")[0], args, tokenizer),
    )
    kv = await js.key_value(projection.ENDPOINTS_BUCKET)
    await kv.put(projection.model_key(MODEL), c.encode(rec))
    config = f"nats_url: {nats_url}\nlog_level: warning\naccess_log: false\n"
    # default@N: the rule's rate at N; default@N/field=value/...: prefix fields too
    name, _, fixed = name.partition("@")
    prefix = {}
    if args.tokens_per_request is not None:
        prefix["affinity_tokens_per_request"] = str(args.tokens_per_request)
    for item in filter(None, fixed.split("/")):
        field, eq, value = item.partition("=")
        prefix.update({field: value} if eq else {"affinity_tokens_per_request": item})
    if prefix:
        config += "prefix: {" + ", ".join(f"{k}: {v}" for k, v in prefix.items()) + "}\n"
    if args.router_config:
        config += args.router_config + "\n"
    routers = []
    try:
        for _ in range(2):
            routers.append(await asyncio.to_thread(start_router, directory, config))
        await wait_routed([r.url for r in routers])
    except BaseException:
        for r in routers:
            r.stop()
        raise
    return routers


async def run_policy(name, args, nats_url, js, directory, kv_blocks) -> Result:
    async with engines(nats_url, kv_blocks, args.pin) as (relays, sims):
        stop = []
        try:
            if name in VLLM_ROUTER_POLICIES:
                procs = vllm_routers(name, sims, directory)
                stop = [p.terminate for p in procs]
                urls = [p.url for p in procs]  # type: ignore[attr-defined]
                pids = [p.pid for p in procs]
            else:
                eps = [
                    c.Endpoint(id=f"e{i}", url=s.url, node=NODE, engine="sim")
                    for i, s in enumerate(sims)
                ]
                routers = await start_llmgw(name, args, eps, js, nats_url, directory)
                stop = [r.stop for r in routers]
                urls = [r.url for r in routers]
                pids = [r.proc.pid for r in routers]
            before = engine_counters(sims)
            cpu = cpu_seconds(pids)
            result = await drive(urls, args.seconds, args.clients, relays, name, rate=args.rate)
            result.router_cpu = cpu_seconds(pids) - cpu
            after = engine_counters(sims)
            hits, queries = after[0] - before[0], after[1] - before[1]
            result.hit_rate = hits / queries if queries else 0.0
            return result
        finally:
            for s in stop:
                with contextlib.suppress(Exception):
                    s()


async def wait_routed(urls) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(timeout=5) as http:
        for url in urls:
            for _ in range(200):
                with contextlib.suppress(httpx.HTTPError):
                    if (
                        await http.post(url + "/v1/chat/completions", json=body)
                    ).status_code == 200:
                        break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"router {url} never served the model")


def index_bytes_per_million() -> float:
    """The router index's memory per million blocks (two endpoints holding each block)."""
    n = 200_000
    index = BlockIndex(max_blocks=n)
    batch = c.KvEvents(node="n", shard_id="a", epoch="e", seq_first=0, seq_last=0, ops=[])
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    hashes = [random.getrandbits(63) for _ in range(n)]
    for ep in ("a", "b"):
        index.offer(ep, batch)
        index.snapshot(
            ep, c.KvSnapshot(node="n", shard_id=ep, epoch="e", seq=0, block_size=16, hashes=[])
        )
    for ep in ("a", "b"):
        st = index.endpoints[ep]
        for h in hashes:
            index._store(index.blocks, st, 1 << st.slot, h)
    del hashes  # the list goes; its ints live on as the index's keys, and are counted
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / n * 1_000_000


def pin_here(pin: bool) -> str:
    """With `pin`, this process and everything it starts from now on (NATS, the routers)
    on ROUTER_CPU; the engines are started on ENGINE_CPU. Says where things run."""
    if not pin:
        return "unpinned (routers, engines and load generator share every CPU)"
    os.sched_setaffinity(0, {ROUTER_CPU})
    return f"pinned: routers and load generator on CPU {ROUTER_CPU}, engines on CPU {ENGINE_CPU}"


async def main_async(args) -> int:
    pinning = pin_here(args.pin)
    directory = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    server = localservers.NatsServer(directory / "nats").start()
    regimes: list[tuple[int, list[Result]]] = []
    try:
        nc = await bus.connect(server.url, name="bench")
        js = nc.jetstream()
        await bus.provision(js)
        policies = available(args.policies.split(","))
        for kv_blocks in (int(b) for b in args.sim_kv_blocks.split(",")):
            results: list[Result] = []
            for run in range(args.repeat):
                for name in rotated(policies, run):
                    print(f"sim, {kv_blocks} blocks: {name} for {args.seconds:.0f}s", flush=True)
                    result = await run_policy(name, args, server.url, js, directory, kv_blocks)
                    result.run = run
                    results.append(result)
            regimes.append((kv_blocks, results))
        await bus.close_quietly(nc)
    finally:
        server.stop()
    ok = True
    for kv_blocks, results in regimes:
        print(
            f"\n4 sim engines, {kv_blocks} blocks of {BLOCK} tokens each "
            f"({'evicting' if kv_blocks <= EVICTING_SIM_BLOCKS else 'nothing evicts'}), "
            f"max_num_seqs {SIM['max_num_seqs']}, {TENANTS} tenants, "
            f"{args.clients} clients{paced(args)}, "
            f"2 routers round-robin; machine load average {os.getloadavg()[1]:.1f} "
            f"on {os.cpu_count()} CPUs, {pinning} (TTFT includes the routers' CPU time: on "
            "a saturated machine the Python routers' queueing hides the engines' prefill)"
        )
        ok &= report(results, sim_targets=True, evicting=kv_blocks <= EVICTING_SIM_BLOCKS)
    per_million = index_bytes_per_million()
    print(f"\nrouter block index: {per_million / 1e6:.0f} MB per million blocks")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def available(policies: list[str]) -> list[str]:
    if HAVE_VLLM_ROUTER:
        return policies
    for name in VLLM_ROUTER_POLICIES:
        if name in policies:
            print(f"{name}: skipped, no vllm-router at {VLLM_ROUTER}", flush=True)
    return [p for p in policies if p not in VLLM_ROUTER_POLICIES]


def paced(args) -> str:
    return f" paced at {args.rate:g} req/s" if args.rate else " (closed loop)"


def rotated(policies: list[str], run: int) -> list[str]:
    """Round `run`'s order: each round starts one policy later, so no policy always runs
    first (on a warming engine) or always follows the same one, and a drift of the
    machine's speed over the rounds falls on every policy alike."""
    k = run % len(policies)
    return policies[k:] + policies[:k]


def pooled(results: list[Result]) -> dict[str, Result]:
    """Per policy, every run's requests together (hit rates averaged over the runs)."""
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(r.name, []).append(r)
    out = {}
    for name, runs in by.items():
        p = Result(name, run=-1, seconds=sum(r.seconds for r in runs))
        p.ttfts = [t for r in runs for t in r.ttfts]
        p.errors = sum(r.errors for r in runs)
        p.hit_rate = statistics.fmean(r.hit_rate for r in runs)
        p.oracle = statistics.fmean(r.oracle for r in runs)
        p.router_cpu = sum(r.router_cpu for r in runs)
        out[name] = p
    return out


def print_rows(results: list[Result], notes: bool) -> None:
    print(
        f"{'policy':<15} {'mean TTFT':>10} {'p90 TTFT':>10} {'req/s':>7} {'hit rate':>9} "
        f"{'oracle':>7} {'errors':>6} {'router CPU/req':>14}" + ("  events" if notes else "")
    )
    for r in results:
        label = r.name if r.run < 0 else f"{r.name} #{r.run + 1}"
        print(
            f"{label:<15} {r.mean * 1000:>8.0f}ms {r.p90 * 1000:>8.0f}ms {r.throughput:>7.1f} "
            f"{r.hit_rate:>8.1%} {r.oracle:>7.1%} {r.errors:>6} "
            f"{r.cpu_per_request * 1000:>12.2f}ms" + (f"  {r.note}" if notes else "")
        )


def paired_runs(results: list[Result], name: str, base: str) -> list[tuple[Result, Result]]:
    """Each round's run of `name` with its run of `base`, rounds where either has no TTFT
    left out (a round's two runs share the machine's state of the moment)."""
    runs: dict[int, dict[str, Result]] = {}
    for r in results:
        if r.ttfts:
            runs.setdefault(r.run, {})[r.name] = r
    return [
        (both[name], both[base])
        for _, both in sorted(runs.items())
        if name in both and base in both
    ]


# Student's t at 95% one-sided (a two-sided 90% interval), by degrees of freedom. Rounds
# are few, and the normal's 1.645 would be too narrow.
_T90 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860,
        9: 1.833, 10: 1.812, 12: 1.782, 15: 1.753, 20: 1.725, 25: 1.708, 30: 1.697,
        40: 1.684, 60: 1.671, 120: 1.658}  # fmt: skip
MIN_ROUNDS = 3


def t90(df: int) -> float:
    """The table's value for the largest tabled df not above `df` (so never too narrow)."""
    return _T90[max(k for k in _T90 if k <= df)]


def round_gap(pairs: list[tuple[Result, Result]]) -> tuple[float, float, float] | None:
    """The gap of the first policy's mean TTFT to the second's over rounds, with a 90%
    interval: Student's t over the rounds' paired log ratios, back as a gap (the rounds'
    geometric mean ratio - 1, and its bounds). None below MIN_ROUNDS rounds.

    One run's mean moves with the machine by tens of percent from round to round (two
    engines time-slicing one CPU, a shared host), and both runs of a round move together,
    so the rounds' ratios, not the runs, are the samples; the interval then says whether
    the rounds settle the 5% target or more are needed. Each round's ratio is printed
    with the run means, so rounds of several invocations can be pooled by hand."""
    logs = [math.log(a.mean / b.mean) for a, b in pairs]
    n = len(logs)
    if n < MIN_ROUNDS:
        return None
    mid = statistics.fmean(logs)
    half = t90(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(mid) - 1, math.exp(mid - half) - 1, math.exp(mid + half) - 1


def settled(pairs: list[tuple[Result, Result]], target: float) -> str:
    """Whether the rounds decide `gap <= target`: the whole interval on one side of it."""
    rounds = len(pairs)
    gap = round_gap(pairs)
    if gap is None:
        return f"{rounds} rounds with both policies: no interval below {MIN_ROUNDS}"
    mid, lo, hi = gap
    if hi <= target:
        verdict = "the rounds settle the target: met"
    elif lo > target:
        verdict = "the rounds settle the target: missed"
    else:
        verdict = "the rounds do not settle the target"
    return (
        f"over {rounds} rounds the gap is {mid:+.1%} (90% interval {lo:+.1%}..{hi:+.1%}): "
        f"{verdict} (information; PASS/FAIL above is the pooled gap)"
    )


def report(results: list[Result], sim_targets: bool, evicting: bool, notes: bool = False) -> bool:
    """The regime's table (each run, then every run pooled) and the issue's targets: the
    default within 5% of round robin's mean TTFT in every regime; on the sims, also its
    hit rate within 5 points of the oracle, and on the evicting sims its mean TTFT at
    least 30% below cache_aware's (the gain the sim bench had, on the caches it had:
    where nothing evicts every policy's hit rate nears the oracle's, and that comparison
    is printed for information). The same routers balancing alone (least_inflight) and
    spreading obliviously (random_key) are printed beside, for information: they tell
    the decisions' cost from the routers' own."""
    print_rows(results, notes)
    by = pooled(results)
    if len({r.run for r in results}) > 1:
        print("all runs pooled:")
        print_rows(list(by.values()), notes=False)
    ok = True
    d, rr = by.get("default"), by.get("round_robin")
    if d is None:
        return False
    if rr is not None and rr.ttfts:
        worse = d.mean / rr.mean - 1
        pairs = paired_runs(results, "default", "round_robin")
        ratios = [a.mean / b.mean - 1 for a, b in pairs]
        runs = ", ".join(f"{r:+.0%}" for r in ratios) or "none paired"
        median = f"; their median {statistics.median(ratios):+.1%}" if ratios else ""
        good = worse <= TARGET_VS_ROUND_ROBIN
        ok &= good
        print(
            f"{'PASS' if good else 'FAIL'}: default mean TTFT {d.mean * 1000:.0f}ms is "
            f"{worse:+.1%} vs round robin's {rr.mean * 1000:.0f}ms (target <= +5%; "
            f"per round {runs}{median})"
        )
        print(f"      {settled(pairs, TARGET_VS_ROUND_ROBIN)}")
    else:
        print("SKIP: no vllm-router round_robin run to compare TTFT with")
    for baseline, what in (
        ("least_inflight", "the same routers balancing alone"),
        ("random_key", "the same routers with no scorers: ties in turn, as round robin"),
    ):
        base = by.get(baseline)
        if base is not None and base.ttfts:
            print(
                f"info: default mean TTFT is {d.mean / base.mean - 1:+.1%} vs {baseline}'s "
                f"{base.mean * 1000:.0f}ms ({what})"
            )
    if sim_targets:
        gap = d.oracle - d.hit_rate
        good = gap <= TARGET_ORACLE_GAP
        ok &= good
        print(
            f"{'PASS' if good else 'FAIL'}: default hit rate {d.hit_rate:.1%} is "
            f"{gap * 100:.1f} points below its oracle {d.oracle:.1%} (target <= 5)"
        )
        ca = by.get("cache_aware")
        if ca is not None and ca.ttfts:
            cut = 1 - d.mean / ca.mean
            good = cut >= TARGET_TTFT_CUT
            line = (
                f"default mean TTFT {d.mean * 1000:.0f}ms is {cut:.0%} below cache_aware's "
                f"{ca.mean * 1000:.0f}ms"
            )
            if evicting:
                ok &= good
                print(f"{'PASS' if good else 'FAIL'}: {line} (target >= 30%)")
            else:
                print(f"info: {line} (the 30% target is the evicting regime's)")
        else:
            print("SKIP: no vllm-router cache_aware run to compare TTFT with")
    errors = sum(r.errors for r in results)
    if errors:
        print(f"note: {errors} failed requests")
    return ok


# ------------------------------------------------------------------ real vLLM


def engine_counters_text(texts: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for text in texts:
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def start_vllm(
    python: str, model: str, relay: EngineRelay, directory: Path, kv_blocks: int, pin: bool
):
    """A vLLM CPU engine; `kv_blocks` > 0 caps its KV cache at that many blocks
    (--num-gpu-blocks-override, which vllm-cpu honours; VLLM_CPU_KVCACHE_SPACE counts
    whole GiB, far more than the tiny model needs), 0 leaves the default 1 GiB. `pin`:
    its processes on ENGINE_CPU, and its OpenMP threads bound there (vLLM CPU binds
    them itself, by VLLM_CPU_OMP_THREADS_BIND, `auto` when unset)."""
    port = localservers.free_port()
    log = open(directory / f"vllm-{port}.log", "wb")  # noqa: SIM115
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024",
        "--kv-events-config", relay_flag(relay),
    ]  # fmt: skip
    if kv_blocks:
        cmd += ["--num-gpu-blocks-override", str(kv_blocks)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    if pin:
        cmd = ["taskset", "-c", str(ENGINE_CPU), *cmd]
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(ENGINE_CPU)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    proc.log_path = directory / f"vllm-{port}.log"  # type: ignore[attr-defined]
    return proc


@contextlib.asynccontextmanager
async def vllm_engines(args, relays: KvRelays, directory: Path, kv_blocks: int):
    """Two vLLM engines relaying KV events, healthy, stopped on the way out."""
    procs = []
    try:
        for i in range(2):
            relay = relays.open(f"v{i}")
            procs.append(
                start_vllm(args.vllm_python, args.vllm_model, relay, directory, kv_blocks, args.pin)
            )
            relay.url = procs[-1].url
        began = time.monotonic()
        async with httpx.AsyncClient(timeout=5) as http:
            for p in procs:
                while True:
                    if p.poll() is not None:
                        raise RuntimeError(f"vLLM exited: see {p.log_path}")
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(p.url + "/health")).status_code == 200:
                            break
                    if time.monotonic() - began > 600:
                        raise RuntimeError("vLLM did not become healthy in 600s")
                    await asyncio.sleep(0.5)
        print(f"2 vLLM engines healthy after {time.monotonic() - began:.0f}s", flush=True)
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(Exception):
                p.wait(30)
        for i in range(len(procs)):
            await relays.close(f"v{i}")


async def metrics_counters(procs) -> tuple[float, float]:
    async with httpx.AsyncClient(timeout=10) as http:
        return engine_counters_text([(await http.get(p.url + "/metrics")).text for p in procs])


async def run_vllm_policy(name, args, procs, relays, tok, js, nats_url, directory) -> Result:
    """One policy on the engines, their prefix caches reset first (vLLM's dev-mode
    /reset_prefix_cache, which also exercises AllBlocksCleared)."""
    async with httpx.AsyncClient(timeout=10) as http:
        for p in procs:
            (await http.post(p.url + "/reset_prefix_cache")).raise_for_status()
    routers = []
    stop = []
    try:
        if name in VLLM_ROUTER_POLICIES:
            routers = vllm_routers(name, procs, directory)
            stop = [r.terminate for r in routers]
            urls = [r.url for r in routers]  # type: ignore[attr-defined]
            pids = [r.pid for r in routers]
        else:
            eps = [
                c.Endpoint(id=f"v{i}", url=p.url, node=NODE, engine="vllm")
                for i, p in enumerate(procs)
            ]
            routers = await start_llmgw(
                name, args, eps, js, nats_url, directory, tokenizer=args.vllm_model
            )
            stop = [r.stop for r in routers]
            urls = [r.url for r in routers]
            pids = [r.proc.pid for r in routers]
        before = await metrics_counters(procs)
        published = sum(r.published for r in relays.relays.values())
        oracle = Oracle(relays, tok.tokens, completions=True)
        cpu = cpu_seconds(pids)
        result = await drive(urls, args.seconds, args.clients, relays, name, oracle, rate=args.rate)
        result.router_cpu = cpu_seconds(pids) - cpu
        after = await metrics_counters(procs)
        hits, queries = after[0] - before[0], after[1] - before[1]
        result.hit_rate = hits / queries if queries else 0.0
        batches = sum(r.published for r in relays.relays.values()) - published
        held = [len(r.blocks.canon) for r in relays.relays.values()]
        result.note = f"{batches} event batches; blocks held {held}"
        if name == "default":
            # What the routers' indexes hold, per engine: the events reached them.
            async with httpx.AsyncClient(timeout=10) as http:
                for r in routers:
                    eps = (await http.get(r.admin_url + "/debug/endpoints")).json()
                    seen = [e.get("kv_events_blocks") for e in eps["endpoints"]]
                    result.note += f"; router index {seen}"
        return result
    finally:
        for s in stop:
            with contextlib.suppress(Exception):
                s()


async def run_vllm(args) -> int:
    from llmgw.router.kvcache.tokens import HfTokens

    # Prompts that fit the tiny model's 1,024 tokens, whole conversations included.
    global SYSTEM_WORDS, QUESTION_WORDS, TURNS
    SYSTEM_WORDS, QUESTION_WORDS, TURNS = 80, 10, (2, 4)

    pinning = pin_here(args.pin)
    directory = Path(tempfile.mkdtemp(prefix="bench-prefix-vllm-"))
    server = localservers.NatsServer(directory / "nats").start()
    nc = await bus.connect(server.url, name=f"agent-{NODE}")
    relays = KvRelays(NODE, kvsockets.prepare(directory / kvsockets.DIR_NAME))
    await relays.attach(nc)
    js = nc.jetstream()
    await bus.provision(js)
    tok = HfTokens(args.vllm_model)  # raises if the model's tokenizer cannot be loaded
    policies = available(args.policies.split(","))
    regimes: list[tuple[int, list[Result], int]] = []
    try:
        for kv_blocks in (int(b) for b in args.vllm_kv_blocks.split(",")):
            results: list[Result] = []
            async with (
                vllm_engines(args, relays, directory, kv_blocks) as procs,
                agent_load_samples(nc, {f"v{i}": p.url for i, p in enumerate(procs)}),
            ):
                # Unmeasured: a fresh engine's first batches are slower (allocations,
                # first shapes), and would count against whichever policy ran first.
                print(f"vLLM, kv blocks {kv_blocks or 'default'}: warm-up", flush=True)
                await run_vllm_policy(
                    policies[0], args, procs, relays, tok, js, server.url, directory
                )
                for run in range(args.repeat):
                    for name in rotated(policies, run):
                        print(f"vLLM, kv blocks {kv_blocks or 'default'}: {name}", flush=True)
                        result = await run_vllm_policy(
                            name, args, procs, relays, tok, js, server.url, directory
                        )
                        result.run = run
                        results.append(result)
                block_size = next(iter(relays.relays.values())).blocks.block_size
            regimes.append((kv_blocks, results, block_size))
    finally:
        await relays.stop()
        await bus.close_quietly(nc)
        server.stop()
    ok = True
    for kv_blocks, results, block_size in regimes:
        cache = f"{kv_blocks} KV blocks each (evicting)" if kv_blocks else "the default KV cache"
        print(
            f"\nreal vLLM: 2 CPU engines, {cache}, block size {block_size}, "
            f"{args.clients} clients{paced(args)}, completions, {args.seconds:.0f}s per run; "
            f"machine load average {os.getloadavg()[1]:.1f} on {os.cpu_count()} CPUs, {pinning}\n"
        )
        ok &= report(results, sim_targets=False, evicting=bool(kv_blocks), notes=True)
        # Any policy's run will do: the engines publish their events whoever routes.
        flowing = all(not r.errors for r in results) and any(
            not r.note.startswith("0 event batches") for r in results
        )
        print("PASS: events flow from real vLLM" if flowing else "FAIL: no events from vLLM")
        ok &= flowing
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument(
        "--policies",
        default="round_robin,least_inflight,approximate,default,cache_aware",
        help="a subset (also random_key, random, power_of_two), or scorers:NAME=WEIGHT/"
        "NAME=WEIGHT for the llmgw routers, or default@N (the rule's rate fixed at N tokens "
        "per request), or default@N/FIELD=VALUE/... (prefix: fields too)",
    )
    parser.add_argument("--repeat", type=int, default=2, help="rounds of the policies, interleaved")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="at most this many requests a second over all clients (0: a closed loop); "
        "below every policy's capacity, each policy's TTFT is measured at the same load",
    )
    parser.add_argument(
        "--kv-weight", type=float, help="the kv_prefix (and prefix) weight (default: the default's)"
    )
    parser.add_argument(
        "--tokens-per-request",
        type=int,
        help="the routers' prefix.affinity_tokens_per_request",
    )
    parser.add_argument("--router-config", help="YAML added to the llmgw routers' config")
    parser.add_argument(
        "--sim-kv-blocks", default=SIM_KV_BLOCKS, help="each sim regime's KV blocks per engine"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        help="routers and load generator on CPU 0, engines on CPU 1 (default: on for real "
        "vLLM, off for the sims)",
    )
    parser.add_argument("--vllm-python", help="a vLLM environment's python: run on real vLLM")
    parser.add_argument("--vllm-model", help="the model directory vLLM serves (with a tokenizer)")
    parser.add_argument(
        "--vllm-kv-blocks",
        default=VLLM_KV_BLOCKS,
        help="each real-vLLM regime's KV blocks per engine (0: vLLM's default cache)",
    )
    args = parser.parse_args()
    if not [
        p for p in args.policies.split(",") if HAVE_VLLM_ROUTER or p not in VLLM_ROUTER_POLICIES
    ]:
        print(f"FAIL: no policy left to run (no vllm-router at {VLLM_ROUTER})")
        return 1
    if args.pin is None:
        args.pin = bool(args.vllm_python)
    if args.vllm_python:
        if not args.vllm_model:
            from llmgw.dev import tinymodel

            cache = Path.home() / ".cache" / "llmgw" / "models"
            args.vllm_model = str(tinymodel.ensure(args.vllm_python, cache))
        return asyncio.run(run_vllm(args))
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
