"""Streamed requests/s through one router (`--workers 2`) at 64 clients, with nginx alongside.

    .venv/bin/python tests/bench/bench_router_throughput.py [--seconds 5] [--rounds 3] [--profile]

One fast upstream (16 SSE events per answer, at once). In the same run, in
turns: direct to the upstream; nginx as a plain reverse proxy (2 worker
processes, upstream keep-alive, no buffering; skipped with a note when nginx
is not installed); a bare relay (Starlette, one raw ASGI
endpoint, aiohttp, nothing else; 2 workers); and the router with 2 workers and
its full pipeline. `wrk` with 64 connections is the load; the best of the
rounds counts (on a shared machine the slowest rounds measure the neighbours).
Target: the router >= 4,500 req/s. The ratios say what the pipeline costs
against the bare relay and what Python costs against nginx.

--profile samples one router worker with py-spy during an extra router run and
prints where its time goes, grouped by layer.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _router_bench as rb  # noqa: E402

TARGET_RPS = 4500
CLIENTS = 64

# py-spy frames grouped into what a reader of the profile cares about.
LAYERS = [
    (
        "router: proxy (parse, dispatch, relay)",
        ("router/request/handler.py", "router/request/body.py"),
    ),
    (
        "router: scheduling pipeline",
        ("router/scheduling/", "router/relay/circuit.py"),
    ),
    ("router: deadlines and disconnect guard", ("router/request/guard.py",)),
    ("router: metrics", ("router/metrics.py",)),
    ("router: admission", ("router/admission/",)),
    ("uvicorn (client side HTTP, ASGI send)", ("uvicorn/",)),
    ("starlette (routing, middleware)", ("starlette/",)),
    ("router: upstream HTTP client", ("router/relay/http1.py", "httptools/")),
    ("aiohttp client (upstream HTTP)", ("aiohttp/", "aiohappyeyeballs/", "yarl/", "multidict/")),
    ("asyncio / event loop", ("asyncio/", "uvloop/")),
]


def profile(pid: int, seconds: int, url: str) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("profile: py-spy not installed (pip install py-spy); skipped")
        return
    out = Path(tempfile.mkdtemp()) / "profile.txt"
    proc = subprocess.Popen(
        [spy, "record", "-p", str(pid), "-d", str(seconds + 1), "-r", "250", "-f", "raw",
         "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    load = threading.Thread(target=rb.wrk, args=(url, CLIENTS, seconds, 2))
    load.start()
    load.join()
    proc.wait()
    if not out.exists():
        print("profile: py-spy could not attach (needs ptrace permission); skipped")
        return
    by_layer: collections.Counter[str] = collections.Counter()
    by_func: collections.Counter[str] = collections.Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "runners.py" not in stack:
            continue  # not the event loop's thread (uvicorn's supervisor pipe, idle)
        count = int(n)
        total += count
        leaf = stack.split(";")[-1]
        m = re.search(r"^(.*) \((.*?)(?::\d+)?\)$", leaf)
        func, path = (m.group(1), m.group(2)) if m else (leaf, "")
        layer = next((name for name, keys in LAYERS if any(k in path for k in keys)), "other")
        by_layer[layer] += count
        short = "/".join(path.split("/")[-2:])
        by_func[f"{func} ({short})"] += count
    print(f"\nprofile of one router worker ({total} samples at 250 Hz, self time by layer):")
    for layer, count in by_layer.most_common():
        print(f"  {100 * count / total:5.1f}%  {layer}")
    print("top functions (self time):")
    for func, count in by_func.most_common(12):
        print(f"  {100 * count / total:5.1f}%  {func}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    up = rb.fast_upstream()
    started: list[rb.Proc] = []
    try:
        targets: dict[str, rb.Proc | None] = {"direct": up}
        targets["nginx"] = ng = rb.nginx(tmp, up.port)
        if ng is not None:
            started.append(ng)
        targets["bare relay x2"] = bare = rb.bare_relay(up.port, 2)
        started.append(bare)
        targets["router x2"] = router = rb.router(tmp, [up.port], workers=2, extra=rb.NO_ADMISSION)
        started.append(router)
        results: dict[str, list[rb.WrkResult]] = {name: [] for name in targets}
        for _ in range(args.rounds):
            for name, proc in targets.items():
                if proc is not None:
                    url = f"http://127.0.0.1:{proc.port}/v1/chat/completions"
                    results[name].append(rb.wrk(url, CLIENTS, args.seconds, threads=2))
        best = {n: max(r, key=lambda x: x.rps) for n, r in results.items() if r}
        errors = sum(x.errors for r in results.values() for x in r)
        rps = best["router x2"].rps
        print(
            f"streamed req/s at {CLIENTS} clients, best of {args.rounds} rounds of {args.seconds}s"
        )
        print(f"{'path':<16} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}  rounds")
        for name, b in best.items():
            rounds = " ".join(f"{x.rps:.0f}" for x in results[name])
            print(f"{name:<16} {b.rps:>9.0f} {b.p50_ms:>8.2f} {b.p99_ms:>8.2f}  {rounds}")
        if ng is None:
            print("nginx: not installed (apt-get install -y nginx); its ratio is not reported")
        else:
            print(f"router / nginx:      {rps / best['nginx'].rps:.2f}")
        print(f"router / bare relay: {rps / best['bare relay x2'].rps:.2f}")
        ok = rps >= TARGET_RPS and errors == 0
        print(
            f"target: router x2 >= {TARGET_RPS} req/s with no errors "
            f"({rps:.0f} req/s, {errors} errors): {'PASS' if ok else 'FAIL'}"
        )
        if args.profile:
            worker = max(router.pids[1:] or router.pids)
            profile(
                worker, int(args.seconds), f"http://127.0.0.1:{router.port}/v1/chat/completions"
            )
        return 0 if ok else 1
    finally:
        for proc in started:
            proc.stop()
        up.stop()


if __name__ == "__main__":
    sys.exit(main())
