"""Helpers for end-to-end tests on a whole local cluster (the one `llmgw dev` starts).

`start_cluster()` runs the real processes (NATS, Postgres, reconcilers,
agents, routers, sim engines) on loopback; `Traffic` keeps OpenAI clients
busy against the routers in a background thread and records every failure, so
a test can say "no request failed during this fault".
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from llmgw import procs
from llmgw.dev import cluster as devcluster


def start_cluster(
    data_dir: Path, *, env: dict[str, str] | None = None, **overrides
) -> devcluster.DevCluster:
    # A loaded shared box can take minutes to start eight processes; a quiet one takes ~10 s.
    defaults = {"fresh": True, "ready_timeout": 180.0, "quiet": True}
    spec = devcluster.ClusterSpec(data_dir=data_dir, **{**defaults, **overrides})
    cluster = devcluster.DevCluster(spec, env=env)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def cli(
    cluster: devcluster.DevCluster, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess:
    env = {"LLMGW_API_URL": cluster.info["api_url"], "LLMGW_NATS_URL": cluster.info["nats_url"]}
    env["LLMGW_DATABASE_URL"] = cluster.info["database_url"]
    env["LLMGW_API_TOKEN"] = cluster.info["api_token"]
    for key, path in cluster.info.get("api_tls", {}).items():  # --secure: the operator's
        env[f"LLMGW_API_TLS__{key.upper()}"] = path
    import os

    return subprocess.run(
        procs.llmgw_argv(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def events(cluster: devcluster.DevCluster, type_: str, model: str | None = None) -> list[dict]:
    """The cluster's events of one type (and model), oldest first, as `llmgw events
    export` gives them."""
    res = cli(cluster, "events", "export", "--from-seq", "1", "--api", cluster.info["api_url"])
    assert res.returncode == 0, res.stderr
    out = []
    for line in res.stdout.splitlines():
        ev = json.loads(line)
        ev = ev.get("event") or ev
        if ev.get("type") == type_ and (model is None or ev.get("model") == model):
            out.append(ev)
    return out


def api_headers(cluster: devcluster.DevCluster) -> dict[str, str]:
    """The dev cluster's admin token, as the operator API wants it."""
    return {"Authorization": f"Bearer {cluster.info['api_token']}"}


def api(cluster: devcluster.DevCluster, path: str, base: str | None = None) -> Any:
    url = f"{base or cluster.info['api_url']}{path}"
    return httpx.get(url, headers=api_headers(cluster), timeout=5, verify=cluster.api_verify).json()


def leader_api(cluster: devcluster.DevCluster) -> str | None:
    for base in cluster.info["api_urls"]:
        try:
            r = httpx.get(f"{base}/readyz", timeout=2, verify=cluster.api_verify)
        except httpx.HTTPError:
            continue
        if r.status_code == 200 and "leader" in r.text and "standby" not in r.text:
            return base
    return None


def apply_catalog(cluster: devcluster.DevCluster, catalog: dict) -> subprocess.CompletedProcess:
    path = Path(cluster.info["data_dir"]) / f"catalog-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(catalog, sort_keys=False))
    res = cli(cluster, "apply", "-f", str(path), "--nats", cluster.info["nats_url"])
    assert res.returncode == 0, res.stderr + res.stdout
    return res


def demo_catalog(cluster: devcluster.DevCluster) -> dict:
    keys = json.loads((Path(cluster.info["data_dir"]) / "demo-keys.json").read_text())
    return devcluster.demo_catalog(keys)


def ready_endpoints(cluster: devcluster.DevCluster, model: str) -> list[dict]:
    for row in _list(api(cluster, "/api/endpoints")):
        if row.get("model") == model:
            return [e for e in row.get("endpoints", []) if e.get("state") == "ready"]
    return []


def _list(body: Any) -> list:
    if isinstance(body, dict):
        body = next((v for v in body.values() if isinstance(v, list)), [])
    return body if isinstance(body, list) else []


def router_endpoint_urls(admin_base: str, model: str) -> set[str]:
    """The endpoint URLs a router would send `model` to right now (its debug view)."""
    body = httpx.get(f"{admin_base}/debug/endpoints", timeout=2).json()
    out = set()
    for ep in _list(body):
        if model in ep.get("models", []) and ep.get("state") == "ready":
            out.add(ep["url"])
    return out


def wait(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the thing we wait for may be down for a while
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_exc!r})"
    )


class Traffic:
    """Concurrent OpenAI requests (half streaming) against every router until stopped."""

    def __init__(
        self,
        routers: list[str],
        api_key: str,
        model: str,
        concurrency: int = 4,
        max_tokens: int = 8,
    ):
        self.routers = routers
        self.api_key = api_key
        self.model = model
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        # max_retries=0: the SDK must not hide a failure by retrying it.
        clients = [
            openai.AsyncOpenAI(base_url=r, api_key=self.api_key, max_retries=0, timeout=20)
            for r in self.routers
        ]
        await asyncio.gather(
            *(self._worker(i, clients[i % len(clients)]) for i in range(self.concurrency))
        )
        for c in clients:
            await c.close()

    async def _worker(self, i: int, client: openai.AsyncOpenAI) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                messages = [{"role": "user", "content": f"worker {i} request {n}"}]
                if n % 2:
                    stream = await client.chat.completions.create(
                        model=self.model, messages=messages, max_tokens=self.max_tokens, stream=True
                    )
                    got = 0
                    async for chunk in stream:
                        got += sum(1 for ch in chunk.choices if ch.delta.content)
                    if got == 0:
                        raise RuntimeError("stream ended without content")
                else:
                    resp = await client.chat.completions.create(
                        model=self.model, messages=messages, max_tokens=self.max_tokens
                    )
                    if not resp.choices[0].message.content:
                        raise RuntimeError("empty completion")
                self.ok += 1
            except Exception as exc:
                self.failures.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}")
                await asyncio.sleep(0.05)


def log_tail(cluster: devcluster.DevCluster, name: str, lines: int = 40) -> str:
    child = cluster.group.children.get(name)
    return "\n".join(list(child.tail)[-lines:]) if child else ""


__all__ = ["sys"]
