"""What a user of `docker compose up` sees: OpenAI calls through the load balancer,
the operator API with a token, an audit inside a container, losing a router under
load, and state kept across `down`/`up`. The tests run in order on one cluster."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import FIGURES, ROOT

pytestmark = pytest.mark.compose

KEY = "sk-llmgw-demo-interactive"
# The CLI of the environment running the tests, whether or not it is on PATH.
LLMGW = str(Path(sys.executable).with_name("llmgw"))


def _client(base: str, transport: httpx.HTTPTransport | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base}/v1",
        api_key=KEY,
        timeout=30,
        http_client=httpx.Client(transport=transport) if transport else None,
    )


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if value := predicate():
                return value
        except Exception as exc:  # not up yet: say what it was when the deadline passes
            last = exc
        else:
            last = None
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s (last error: {last!r})")
        time.sleep(0.5)


def _llmgw(compose, *args: str) -> subprocess.CompletedProcess:
    """The CLI on the host, pointed at the compose cluster as docs/deploy.md says."""
    return subprocess.run(
        [LLMGW, *args, "--api", compose.api],
        env={**compose.env, "LLMGW_API_TOKEN": compose.token},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_openai_calls_through_the_load_balancer(compose):
    client = _client(compose.lb)
    # `up --wait` returns with the catalog applied; the replicas come up after it.
    _wait(
        lambda: client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        ),
        120,
        "a chat answer through the load balancer",
    )
    assert {"demo-chat", "chat"} <= {m.id for m in client.models.list()}
    chat = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 8
    text = client.completions.create(model="demo-chat", prompt="Once upon", max_tokens=6)
    assert text.choices[0].text and text.usage.completion_tokens == 6
    pieces = list(
        client.completions.create(model="demo-chat", prompt="Once upon", max_tokens=6, stream=True)
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices)


def test_operator_api_answers_the_cli_with_a_token_and_refuses_it_without(compose):
    models = _llmgw(compose, "get", "models", "-o", "json")
    assert models.returncode == 0, models.stderr
    assert '"demo-chat"' in models.stdout
    explain = _llmgw(compose, "explain", "demo-chat")
    assert explain.returncode == 0, explain.stderr
    refused = subprocess.run(
        [LLMGW, "get", "models", "--api", compose.api, "--token", "sk-llmgw-not-a-known-key"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "401" in refused.stderr, refused.stderr


def test_audit_verify_inside_a_container(compose):
    out = compose("exec", "-T", "reconciler-1", "llmgw", "audit", "verify", timeout=120)
    assert out.startswith("OK"), out


class CountingTransport(httpx.HTTPTransport):
    """Counts the SDK's attempts, so its retries show in the figures."""

    def __init__(self):
        super().__init__()
        self.attempts = 0

    def handle_request(self, request):
        self.attempts += 1
        return super().handle_request(request)


class RequestLoop(threading.Thread):
    """One client sending requests one at a time (chat, streamed chat, completions),
    with the SDK's default retries, recording each request's latency by phase."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.transport = CountingTransport()
        self.client = _client(base, self.transport)
        self.phase = "before"
        self.latency: dict[str, list[float]] = {}
        self.failed: list[str] = []
        self.done = threading.Event()

    def _one(self, n: int) -> None:
        messages = [{"role": "user", "content": f"request {n}"}]
        if n % 3 == 0:
            self.client.chat.completions.create(model="chat", messages=messages, max_tokens=4)
        elif n % 3 == 1:
            stream = self.client.chat.completions.create(
                model="chat", messages=messages, max_tokens=4, stream=True
            )
            # Read to the end: a stream left half-read is closed by the garbage
            # collector, possibly inside httpx's pool lock (a deadlock seen here).
            chunks = list(stream)
            assert any(c.choices and c.choices[0].delta.content for c in chunks)
        else:
            self.client.completions.create(model="demo-chat", prompt=f"request {n}", max_tokens=4)

    def run(self) -> None:
        n = 0
        while not self.done.is_set():
            phase, started = self.phase, time.monotonic()
            try:
                self._one(n)
            except Exception as exc:
                self.failed.append(f"{phase}: {exc!r}"[:300])
            self.latency.setdefault(phase, []).append(time.monotonic() - started)
            n += 1
            time.sleep(0.05)  # about 15 requests a second: well inside the demo quota

    def figures(self) -> str:
        parts = [
            f"{phase}: {len(ls)} requests, max {max(ls):.2f} s"
            for phase, ls in self.latency.items()
        ]
        total = sum(len(ls) for ls in self.latency.values())
        retries = self.transport.attempts - total
        return f"{'; '.join(parts)}; failed {len(self.failed)}; SDK retries {retries}"


def _router_requests(compose, service: str) -> float:
    """The router's own count of the requests it answered, read from inside it."""
    script = (
        "import urllib.request as u; from prometheus_client.parser import "
        "text_string_to_metric_families as f; print(sum(s.value for m in f(u.urlopen("
        "'http://127.0.0.1:9090/metrics').read().decode()) if m.name == "
        "'llmgw_router_requests' for s in m.samples if s.name.endswith('_total')))"
    )
    return float(compose("exec", "-T", service, "python", "-c", script, timeout=60))


def test_losing_a_router_costs_a_client_nothing(compose):
    loop = RequestLoop(compose.lb)
    loop.start()
    try:
        time.sleep(3)
        loop.phase = "router-1 stopped"
        compose("stop", "router-1")
        time.sleep(15)  # past nginx's fail_timeout (10 s): one retry of the gone router
        loop.phase = "router-1 started"
        compose("start", "router-1")
        _wait(
            lambda: (
                "healthy"
                in subprocess.run(
                    [
                        "docker",
                        "inspect",
                        "-f",
                        "{{.State.Health.Status}}",
                        compose.container("router-1"),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout
            ),
            120,
            "router-1 healthy again",
        )
        # nginx tries it again within its fail_timeout: wait until it answers requests.
        served = _router_requests(compose, "router-1")
        _wait(lambda: _router_requests(compose, "router-1") > served, 60, "router-1 serving")
        loop.phase = "router-2 killed"
        subprocess.run(
            ["docker", "kill", compose.container("router-2")],
            check=True,
            timeout=60,
            capture_output=True,
        )
        time.sleep(15)
    finally:
        loop.done.set()
        loop.join(60)
    assert not loop.is_alive(), "a request hung"
    FIGURES.append(f"request loop: {loop.figures()}")
    compose("start", "router-2")
    assert loop.failed == []
    worst = {phase: max(ls) for phase, ls in loop.latency.items()}
    assert all(v < 2.0 for v in worst.values()), worst  # the bar: no request over 2 s


def _event_lines(compose) -> list[str]:
    res = _llmgw(compose, "events", "export")
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def test_down_and_up_keep_the_event_log(compose):
    before = _event_lines(compose)
    assert before
    started = time.monotonic()
    compose("down", timeout=300)  # volumes kept
    down = time.monotonic() - started
    up = compose.up()
    FIGURES.append(f"down (NATS in lame duck mode): {down:.0f} s; up again: {up:.0f} s")
    after = _wait(lambda: _event_lines(compose), 120, "the operator API back")
    assert after[: len(before)] == before
    volumes = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"name={compose.project}_"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    assert f"{compose.project}_prometheus-data" in volumes
    out = compose("exec", "-T", "reconciler-1", "llmgw", "audit", "verify", timeout=120)
    assert out.startswith("OK"), out
    client = _client(compose.lb)
    _wait(
        lambda: client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        ),
        120,
        "a chat answer after up",
    )
