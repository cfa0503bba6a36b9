"""llmgw's router against the Rust vllm-router on the same cores: req/s at 64 clients, added latency at 1.

    .venv/bin/python tests/bench/bench_router_vs_peer.py [--seconds 4] [--rounds 5] \
        [--cpus 0,1] [--out DIR] [--profile] [--gap-ms 1]

Why: routers are the part of the system that scales with traffic, so requests per
core is what a platform team pays for, and vllm-router (Rust, tokio, hyper) is the
peer a team would otherwise deploy.

The set-up, all in one run:

- one fast upstream (a raw asyncio server, `llmgw.dev.routerkit fast`) answering
  every request with 16 SSE events at once, so neither router waits on it; or,
  with `--gap-ms G`, each event its own write G ms after the last, so each router
  reads and forwards every event on its own, as it does a real engine's tokens
  (a router's cost per event, which all-at-once hides, is then most of its cost);
- vllm-router's cache_aware asks the engine to render each chat request first
  (`POST /v1/chat/completions/render`); the upstream answers that as vLLM 0.32
  does by default (403, scale-out endpoints disabled), so vllm-router pays the
  extra round trip it pays against a real engine, and no more;
- llmgw's router with `--workers 2` and its whole pipeline on: a tenant whose key
  every request carries (authentication, rpm / tpm / concurrency quotas), admission
  enabled with a band whose ceiling (1.0) makes every request pass the saturation
  check, the default scheduling (filters, the default scorers including the prefix
  scorer, load scraping), metrics, request ids;
- vllm-router 0.1.17 from PyPI with its defaults (cache_aware policy, circuit
  breaker, retries, health checks), from its own venv: `$VLLM_ROUTER`, default
  /root/.cache/llmgw/vllm-router-venv/bin/vllm-router. Elsewhere:
  `python -m venv V && V/bin/pip install vllm-router==0.1.17`, then
  `VLLM_ROUTER=V/bin/vllm-router`.

"Per core" is made fair by pinning: both routers start under `taskset -c CPUS`
(default: the first two cores), so llmgw's two worker processes and vllm-router's
tokio runtime (which sizes its worker threads from the affinity mask it starts
with) get the same cores. The upstream and the load generator are not pinned; on
a 2-core machine they share the routers' cores, equally for both routers.

The load is `wrk` (`apt-get install -y wrk`, or build it from its source on a
machine without the package): 64 connections, 2 threads, for throughput; 1
connection for latency, where "added" is a router's p50 / p99 minus the
upstream's own, measured directly in the same round. Every round runs direct,
llmgw and vllm-router in turn (interleaved, so a noisy neighbour hits all three
alike); a round's ratios compare figures from the same few seconds, and the
verdict takes the median round (every round is printed: the spread is the noise).
Each 64-client run also counts the CPU seconds the router's processes used
(psutil: all workers, all threads): requests per CPU second is the per-core
figure that other load on the machine does not distort (it is printed, with
its ratio; the verdict stays on req/s as the targets state them); at one client
the same count gives each router's CPU microseconds per request, the part of its
added latency that is its own work rather than waiting for a core.

Targets: llmgw's req/s >= 1.5x vllm-router's; added p50 at one client <= vllm-router's
+ 0.05 ms; added p99 <= vllm-router's; no errors.

--profile samples both llmgw workers with py-spy (`pip install py-spy`) under an
extra 64-client run: one writes a flame graph (SVG), the other raw collapsed stacks
from which the top self-time functions and layers are printed. Both land in --out
(default: a fresh temporary folder, printed).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import _router_bench as rb  # noqa: E402
from bench_router_throughput import LAYERS  # noqa: E402

from llmgw import keys  # noqa: E402
from llmgw.dev.servers import free_port, wait_for_port  # noqa: E402

VLLM_ROUTER = os.environ.get("VLLM_ROUTER", "/root/.cache/llmgw/vllm-router-venv/bin/vllm-router")
KEY = "sk-bench-tenant"
HEADERS = {"Authorization": f"Bearer {KEY}"}
CLIENTS = 64
TARGET_RPS_RATIO = 1.5
TARGET_P50_SLACK_MS = 0.05

# Every feature on. max_running tells admission the fast upstream's batch capacity
# (its scraped running count is always 0): without it, 64 in flight would read as a
# queue of 63 and the band would (rightly) hold requests back.
PIPELINE = f"""
admission: {{enabled: true}}
bands:
  - {{name: std, ceiling: 1.0}}
tenants:
  - name: bench
    band: std
    key_hashes: ['{keys.hash_key(KEY)}']
    quotas: {{rpm: 100000000, tpm: 1000000000, concurrency: 100000}}
"""


def taskset(cpus: str) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def llmgw_router(tmp: Path, upstream: int, cpus: str) -> rb.Proc:
    port, admin = free_port(), free_port()
    cfg = tmp / "llmgw-router.yaml"
    cfg.write_text(
        f"listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\nworkers: 2\n"
        f"log_level: warning\nmodels:\n  - name: m\nendpoints:\n"
        f"  - {{id: e0, url: 'http://127.0.0.1:{upstream}', models: [m], max_running: 256}}\n"
        + PIPELINE
    )
    p = rb.Proc("llmgw", [*taskset(cpus), rb.LLMGW, "router", "--config", str(cfg)], port)
    wait_for_port("127.0.0.1", admin, 20, p.proc)
    time.sleep(0.5)  # first scrapes land
    return p


def vllm_router(tmp: Path, upstream: int, cpus: str) -> rb.Proc:
    port = free_port()
    argv = [
        *taskset(cpus), VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", "--log-dir", str(tmp / "vllm-router-logs"),
        "--prometheus-port", str(free_port()),
        "--worker-urls", f"http://127.0.0.1:{upstream}",
    ]  # fmt: skip
    p = rb.Proc("vllm-router", argv, port)
    deadline = time.monotonic() + 30
    while httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("vllm-router did not become healthy")
        time.sleep(0.1)
    return p


def summarise(raw: Path, top: int = 15) -> str:
    """Self time by layer and by function from py-spy's raw (collapsed) stacks."""
    by_layer: collections.Counter[str] = collections.Counter()
    by_func: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "runners.py" not in stack:
            continue  # not the event loop's thread
        count = int(n)
        total += count
        leaf = stack.split(";")[-1]
        m = re.search(r"^(.*) \((.*?)(?::\d+)?\)$", leaf)
        func, path = (m.group(1), m.group(2)) if m else (leaf, "")
        layer = next((name for name, keys_ in LAYERS if any(k in path for k in keys_)), "other")
        by_layer[layer] += count
        by_func[f"{func} ({'/'.join(path.split('/')[-2:])})"] += count
    lines = [f"profile of one llmgw worker: {total} samples, self time by layer"]
    lines += [f"  {100 * c / total:5.1f}%  {name}" for name, c in by_layer.most_common()]
    lines.append("top functions (self time)")
    lines += [f"  {100 * c / total:5.1f}%  {name}" for name, c in by_func.most_common(top)]
    return "\n".join(lines)


def profile(router: rb.Proc, seconds: int, out: Path) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("profile: py-spy not installed (pip install py-spy); skipped")
        return
    workers = sorted(router.pids[1:])[-2:]
    if len(workers) < 2:
        print(f"profile: expected two workers, found {router.pids}; skipped")
        return
    flame, raw = out / "llmgw-worker.svg", out / "llmgw-worker.raw.txt"
    common = ["record", "-d", str(seconds + 1), "-r", "250"]
    spies = [
        subprocess.Popen([spy, *common, "-p", str(workers[0]), "-f", "flamegraph", "-o", str(flame)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen([spy, *common, "-p", str(workers[1]), "-f", "raw", "-o", str(raw)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    load = threading.Thread(target=rb.wrk, args=(url, CLIENTS, seconds, 2, HEADERS))
    load.start()
    load.join()
    for s in spies:
        s.wait()
    if not raw.exists():
        print("profile: py-spy could not attach (needs ptrace permission); skipped")
        return
    text = summarise(raw)
    (out / "profile.txt").write_text(text + "\n")
    print(f"\n{text}\nflame graph: {flame}\nraw stacks: {raw}")


def cpu_seconds(proc: rb.Proc) -> float:
    """User + system CPU of a router's processes (all workers, all threads) so far."""
    return rb.cpu_seconds([proc.proc.pid])


def run_rounds(targets: dict[str, rb.Proc], rounds: int, seconds: float):
    """Per round, per target: (64-client result, 1-client result, requests per CPU
    second at 64 clients, CPU microseconds per request at 1 client), in interleaved turns."""
    results: dict[str, list[tuple[rb.WrkResult, rb.WrkResult, float, float]]] = {
        n: [] for n in targets
    }
    for i in range(rounds):
        for name, proc in targets.items():
            url = f"http://127.0.0.1:{proc.port}/v1/chat/completions"
            cpu = cpu_seconds(proc)
            many = rb.wrk(url, CLIENTS, seconds, 2, HEADERS)
            per_cpu = many.requests / max(1e-9, cpu_seconds(proc) - cpu)
            cpu = cpu_seconds(proc)
            one = rb.wrk(url, 1, seconds, 1, HEADERS)
            us_per_req = 1e6 * (cpu_seconds(proc) - cpu) / max(1, one.requests)
            results[name].append((many, one, per_cpu, us_per_req))
        print(f"round {i + 1}/{rounds} done", flush=True)
    return results


def report(results) -> bool:
    direct, ours, peer = results["direct"], results["llmgw"], results["vllm-router"]
    n = len(direct)
    ratio = [ours[i][0].rps / peer[i][0].rps for i in range(n)]
    cpu_ratio = [ours[i][2] / peer[i][2] for i in range(n)]
    added = {
        name: (
            [r[i][1].p50_ms - direct[i][1].p50_ms for i in range(n)],
            [r[i][1].p99_ms - direct[i][1].p99_ms for i in range(n)],
        )
        for name, r in (("llmgw", ours), ("vllm-router", peer))
    }
    med = statistics.median
    print(f"\n{'path':<12} {'req/s@64':>9} {'req/cpu-s':>9} {'p50@1 ms':>9} {'p99@1 ms':>9} "
          f"{'added p50':>9} {'added p99':>9} {'cpu us@1':>8}   (medians of {n} rounds)")  # fmt: skip
    for name, r in results.items():
        a50, a99 = added.get(name, ([0.0], [0.0]))
        print(f"{name:<12} {med(x[0].rps for x in r):>9.0f} {med(x[2] for x in r):>9.0f} "
              f"{med(x[1].p50_ms for x in r):>9.3f} {med(x[1].p99_ms for x in r):>9.3f} "
              f"{med(a50):>9.3f} {med(a99):>9.3f} {med(x[3] for x in r):>8.0f}")  # fmt: skip
    print("by round (req/s@64  req/cpu-s@64  p50/p99@1 ms  cpu us per request@1):")
    for name, r in results.items():
        each = "  ".join(
            f"{x[0].rps:.0f} {x[2]:.0f} {x[1].p50_ms:.3f}/{x[1].p99_ms:.3f} {x[3]:.0f}" for x in r
        )
        print(f"  {name:<12} {each}")
    print(f"llmgw / vllm-router req/s by round: {' '.join(f'{x:.2f}' for x in ratio)}")
    print(
        f"llmgw / vllm-router requests per CPU second by round (neighbours' load cancels out): "
        f"{' '.join(f'{x:.2f}' for x in cpu_ratio)}, median {med(cpu_ratio):.2f}"
    )
    ours50, ours99 = med(added["llmgw"][0]), med(added["llmgw"][1])
    peer50, peer99 = med(added["vllm-router"][0]), med(added["vllm-router"][1])
    errors = sum(many.errors + one.errors for r in results.values() for many, one, _, _ in r)
    verdicts = [
        (f"req/s ratio {med(ratio):.2f} >= {TARGET_RPS_RATIO}", med(ratio) >= TARGET_RPS_RATIO),
        (
            f"added p50 {ours50:.3f} ms <= {peer50:.3f} + {TARGET_P50_SLACK_MS}",
            ours50 <= peer50 + TARGET_P50_SLACK_MS,
        ),
        (f"added p99 {ours99:.3f} ms <= {peer99:.3f}", ours99 <= peer99),
        (f"errors {errors} == 0", errors == 0),
    ]
    for text, ok in verdicts:
        print(f"  {'PASS' if ok else 'FAIL'}  {text}")
    ok = all(v for _, v in verdicts)
    print(f"target: {'PASS' if ok else 'FAIL'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpus", default="0,1", help="cores both routers are pinned to ('' for none)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="upstream pause between its 16 events (0: all at once); with a gap each "
        "event is read and forwarded on its own, as an engine's tokens are",
    )
    args = ap.parse_args()
    if not Path(VLLM_ROUTER).exists():
        print(f"SKIP: no vllm-router at {VLLM_ROUTER} (see this file's docstring)")
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-router-vs-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"output: {out}; routers pinned to cpus {args.cpus or '(none)'}", flush=True)
    up = rb.fast_upstream(args.gap_ms)
    started: list[rb.Proc] = []
    try:
        started.append(llmgw_router(out, up.port, args.cpus))
        started.append(vllm_router(out, up.port, args.cpus))
        targets = {"direct": up, "llmgw": started[0], "vllm-router": started[1]}
        ok = report(run_rounds(targets, args.rounds, args.seconds))
        if args.profile:
            profile(started[0], int(args.seconds), out)
        return 0 if ok else 1
    finally:
        for proc in started:
            proc.stop()
        up.stop()


if __name__ == "__main__":
    sys.exit(main())
