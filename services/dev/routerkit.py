"""Upstreams the router's tests and benchmarks control, and an in-process router.

- `FakeEngine`: an aiohttp server speaking just enough OpenAI to be routed to,
  whose behaviour each test sets: stream these events, answer this status, hang
  before the headers or after N events, drop the connection, report this load
  on /metrics. It records what it received and notices disconnects.
- `fast_upstream`: the fastest upstream Python can offer (a raw asyncio
  protocol answering every POST with 16 SSE events at once, or paced: each its
  own write, `gap` apart, as an engine's tokens come), for benchmarks; a POST
  to a `.../render` path gets vLLM's default 403 instead;
  `python -m llmgw.dev.routerkit fast PORT [GAP_MS]` runs it as its own process.
- `running_router`: a RouterService with its public and admin servers on free
  ports in the current event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from llmgw.dev.servers import free_port


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every series of `name` in a Prometheus text page whose labels match."""
    total = 0.0
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chat_chunks(model: str, n: int, rid: str = "chatcmpl-1", usage: bool = False) -> list[bytes]:
    """n content events, an optional usage event, then [DONE]: a vLLM-shaped stream."""
    out = []
    for i in range(n):
        delta: dict[str, Any] = {"content": f"t{i} "}
        if i == 0:
            delta["role"] = "assistant"
        out.append(
            sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "delta": delta,
                            "finish_reason": "length" if i == n - 1 else None,
                        }
                    ],
                }
            )
        )
    if usage:
        out.append(
            sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": model,
                    "choices": [],
                    "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n},
                }
            )
        )
    out.append(b"data: [DONE]\n\n")
    return out


def response_events(answer: dict[str, Any]) -> list[bytes]:
    """A Responses API stream for `answer`: typed events, the last response.completed."""
    text = answer["output"][0]["content"][0]["text"]
    created = {**answer, "status": "in_progress", "output": [], "usage": None}
    seq = iter(range(100))

    def event(kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    return [
        event("response.created", response=created),
        event("response.in_progress", response=created),
        event("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0,
              delta=text, logprobs=[]),
        event("response.output_text.done", item_id="msg_1", output_index=0, content_index=0,
              text=text, logprobs=[]),
        event("response.completed", response=answer),
    ]  # fmt: skip


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeEngine:
    """One programmable upstream; change its fields between requests."""

    name: str = "engine"
    tokens: int = 4
    delay: float = 0.0  # between events
    status: int = 200
    hang_before_headers: bool = False
    hang_after: int | None = None  # events sent before going silent (a wedged engine)
    drop_after: int | None = None  # events sent before the connection is cut
    events: list[bytes] | None = None  # exact stream to send (else chat_chunks)
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    metrics_status: int = 200
    retry_after: str | None = None  # sent with a 408 / 429 / 503 status
    max_model_len: int = 4096  # what its /v1/models says
    # A prefill engine's KV connector: asked for remote decode, a non-streamed answer
    # carries NixlConnector-shaped `kv_transfer_params` ("nixl", naming this engine)
    # or null ("example": ExampleConnector finds the KV by the prompt).
    kv_connector: str = "nixl"
    prefill_delay: float = 0.0  # seconds a prefill leg (asked for remote decode) takes
    seen: list[Seen] = field(default_factory=list)
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)  # Responses API answers
    active: int = 0  # requests being answered right now
    cancelled: int = 0  # requests whose client went away
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/embeddings", self._embed)
        app.router.add_post("/v1/responses", self._respond)
        app.router.add_get("/v1/responses/{id}", self._stored)
        app.router.add_delete("/v1/responses/{id}", self._stored)
        app.router.add_post("/v1/responses/{id}/cancel", self._stored)
        app.router.add_post("/v1/audio/transcriptions", self._transcribe)
        for path in ("/tokenize", "/detokenize", "/v1/rerank", "/rerank", "/v1/score"):
            app.router.add_post(path, self._echo)
        for path in ("/pooling", "/classify", "/score", "/v2/rerank", "/v1/audio/translations"):
            app.router.add_post(path, self._echo)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self.port = self.port or free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv_usage}\n'
        )
        return web.Response(text=text, status=self.metrics_status)

    def _failure(self) -> web.Response:
        headers = {"Retry-After": self.retry_after} if self.retry_after is not None else None
        return web.json_response(
            {"error": {"message": f"{self.name} fails", "type": "server_error"}},
            status=self.status,
            headers=headers,
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": "m", "object": "model", "max_model_len": self.max_model_len}],
            }
        )

    async def _echo(self, request: web.Request) -> web.Response:
        """vLLM's other endpoints: answers with what it was asked, and where."""
        body = await self._record(request)
        if self.status != 200:
            return self._failure()
        return web.json_response(
            {"path": request.path, "model": body.get("model"), "by": self.name}
        )

    async def _transcribe(self, request: web.Request) -> web.Response:
        form = await request.post()
        self.seen.append(
            Seen(
                request.path,
                {k.lower(): v for k, v in request.headers.items()},
                {k: (v if isinstance(v, str) else v.file.read().decode()) for k, v in form.items()},
            )
        )
        if self.status != 200:
            return self._failure()
        return web.json_response({"text": f"heard by {self.name}"})

    async def _stored(self, request: web.Request) -> web.Response:
        self.seen.append(Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, {}))
        rid = request.match_info["id"]
        if rid not in self.stored:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        if request.method == "DELETE":
            del self.stored[rid]
            return web.json_response({"id": rid, "object": "response", "deleted": True})
        return web.json_response(self.stored[rid])

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        """The Responses API: a stream ends with `event: response.completed`, no [DONE]."""
        body = await self._record(request)
        if self.status != 200:
            return self._failure()
        rid = f"resp_{self.name}_{len(self.seen)}"
        answer = {
            "id": rid,
            "object": "response",
            "created_at": 1,
            "model": body.get("model"),
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": f"from {self.name}", "annotations": []}
                    ],
                }
            ],
            "usage": {
                "input_tokens": 5,
                "output_tokens": 3,
                "total_tokens": 8,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
        self.stored[rid] = answer
        if not body.get("stream"):
            return web.json_response(answer)
        events = self.events or response_events(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, event in enumerate(events):
            if self.drop_after is not None and i >= self.drop_after:
                assert request.transport is not None
                request.transport.abort()
                return resp
            await resp.write(event)
        await resp.write_eof()
        return resp

    async def _record(self, request: web.Request) -> dict[str, Any]:
        body = await request.json()
        self.seen.append(
            Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, body)
        )
        return body

    async def _embed(self, request: web.Request) -> web.Response:
        await self._record(request)
        if self.status != 200:
            return self._failure()
        return web.json_response(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                "model": self.name,
                "usage": {"prompt_tokens": 3, "total_tokens": 3},
            }
        )

    def _kv_params(self) -> dict[str, Any] | None:
        """What a request asking for remote decode gets back as its kv_transfer_params."""
        if self.kv_connector == "example":
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.name,
            "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "tp_size": 1,
        }

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        self.active += 1
        try:
            if self.hang_before_headers:
                await asyncio.sleep(3600)
            if self.status != 200:
                return self._failure()
            model = body.get("model", "m")
            opts = body.get("stream_options") or {}
            events = self.events or chat_chunks(
                model, self.tokens, usage=bool(opts.get("include_usage"))
            )
            if not body.get("stream"):
                answer = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 1,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": f"from {self.name}"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
                }
                asked = body.get("kv_transfer_params")
                if isinstance(asked, dict) and asked.get("do_remote_decode"):
                    answer["kv_transfer_params"] = self._kv_params()
                    await asyncio.sleep(self.prefill_delay)
                return web.json_response(answer)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, event in enumerate(events):
                if self.hang_after is not None and i >= self.hang_after:
                    await asyncio.sleep(3600)
                if self.drop_after is not None and i >= self.drop_after:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await resp.write(event)
                if self.delay:
                    await asyncio.sleep(self.delay)
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


# ------------------------------------------------------------------ fast upstream

_METRICS_PAGE = (
    b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.0\n"
)


def _chunks(parts: list[bytes]) -> list[bytes]:
    """Each part as an HTTP/1.1 chunk, the body's terminator after the last."""
    out = [b"%x\r\n%s\r\n" % (len(p), p) for p in parts]
    out[-1] += b"0\r\n\r\n"
    return out


FAST_EVENTS = chat_chunks("m", 15)  # 15 tokens + [DONE]: 16 events
# The answer's head, then its events: written at once, or one a write when paced.
_FAST_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
_FAST_PIECES = _chunks(FAST_EVENTS)
FAST_RESPONSE = _FAST_HEAD + b"".join(_FAST_PIECES)
_FAST_METRICS = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_METRICS_PAGE),
    _METRICS_PAGE,
)


# vLLM's answer to /v1/*/render (vllm-router's cache_aware asks it to tokenize each chat
# request) when the engine was started without --enable-scale-out, as by default.
_RENDER_ERROR = (
    b'{"error":{"message":"Scale-out endpoints are disabled. Restart vllm serve with '
    b'--enable-scale-out to enable them.","type":"PermissionDeniedError","param":null,'
    b'"code":403}}'
)
_FAST_RENDER = (
    b"HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_RENDER_ERROR), _RENDER_ERROR)
)


class _FastProtocol(asyncio.Protocol):
    """gap: seconds between events, 0 for all at once. With a gap, each event is its own
    write, so a relay reads and forwards each on its own, as it does an engine's tokens;
    a request pipelined behind a paced answer closes the connection (no relay pipelines)."""

    def __init__(self, gap: float = 0.0) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.get = False
        self.url = b""
        self.gap = gap
        self.pacing = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url  # a URL split over reads comes in pieces

    def on_headers_complete(self) -> None:
        self.get = self.parser.get_method() == b"GET"

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.pacing:
            self.transport.close()
            return
        if self.url.endswith(b"/render"):
            self.transport.write(_FAST_RENDER)
            return
        if self.get or not self.gap:
            self.transport.write(_FAST_METRICS if self.get else FAST_RESPONSE)
            return
        self.transport.write(_FAST_HEAD)
        self.pacing = True
        self._paced(0)

    def _paced(self, i: int) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(_FAST_PIECES[i])
        if i + 1 < len(_FAST_PIECES):
            asyncio.get_running_loop().call_later(self.gap, self._paced, i + 1)
        else:
            self.pacing = False


async def fast_upstream(
    port: int, host: str = "127.0.0.1", gap: float = 0.0
) -> asyncio.AbstractServer:
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _FastProtocol(gap), host, port, backlog=4096)


# ------------------------------------------------------------------ in-process router


def config_for(
    engines: list[FakeEngine],
    model: str = "m",
    *,
    roles: dict[str, str] | None = None,
    **overrides: Any,
):
    """A RouterConfig routing `model` to these engines (ids are their names), with
    deadlines short enough for tests; keyword arguments replace config keys.

    `roles` (engine name -> prefill | decode; the others aggregated) makes the model
    disaggregated, with the default `DisaggregationSpec`."""
    from llmgw.contracts import DeadlineSpec, DisaggregationSpec
    from llmgw.router import config as rc

    roles = roles or {}
    disaggregation = DisaggregationSpec() if roles else None
    base = rc.RouterConfig(
        models=[rc.ModelConfig(name=model, disaggregation=disaggregation)],
        endpoints=[
            rc.EndpointConfig(id=e.name, url=e.url, models=[model], role=roles.get(e.name, ""))
            for e in engines
        ],
        model_defaults=rc.ModelDefaults(
            deadlines=DeadlineSpec(connect=1.0, headers=1.0, first_token=1.0, idle=1.0, total=5.0)
        ),
        scrape=rc.ScrapeConfig(interval_seconds=0.05, stale_after_seconds=1.0),
    )
    return msgspec.structs.replace(base, **overrides)


@contextlib.asynccontextmanager
async def fake_engines(*names: str, **kw: Any) -> AsyncIterator[list[FakeEngine]]:
    """Started FakeEngines, one per name, all with the same behaviour `kw`; stopped after."""
    started = [await FakeEngine(name=n, **kw).start() for n in names]
    try:
        yield started
    finally:
        for e in started:
            await e.stop()


@dataclass
class RunningRouter:
    service: Any
    url: str
    admin_url: str


@contextlib.asynccontextmanager
async def running_router(config) -> AsyncIterator[RunningRouter]:
    """A router in this event loop on free ports; `config` is a RouterConfig."""
    from llmgw.router.http.admin import LocalStats, admin_app
    from llmgw.router.http.app import public_app
    from llmgw.router.server import _Server, admin_config, public_config
    from llmgw.router.service import RouterService

    config = msgspec.structs.replace(
        config,
        listen=f"127.0.0.1:{free_port()}",
        admin_listen=f"127.0.0.1:{free_port()}",
    )
    service = RouterService(config)
    public = _Server(public_config(public_app(service), config))
    admin = _Server(admin_config(admin_app(LocalStats(service)), config))
    tasks = [asyncio.create_task(public.serve()), asyncio.create_task(admin.serve())]
    try:
        while not (public.started and admin.started):
            if any(t.done() for t in tasks):
                for t in tasks:
                    if t.done():
                        t.result()
                raise RuntimeError("router servers exited during startup")
            await asyncio.sleep(0.005)
        yield RunningRouter(service, f"http://{config.listen}", f"http://{config.admin_listen}")
    finally:
        public.should_exit = admin.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def bare_relay_app():
    """The floor the router is measured against: Starlette, one raw ASGI endpoint,
    one aiohttp session, chunks relayed as they arrive, nothing else. A uvicorn
    factory; the upstream comes from LLMGW_BARE_UPSTREAM."""
    import os

    import aiohttp
    from starlette.applications import Starlette
    from starlette.routing import Route

    upstream = os.environ["LLMGW_BARE_UPSTREAM"] + "/v1/chat/completions"
    state: dict[str, aiohttp.ClientSession] = {}

    class Relay:  # a class instance, so Starlette mounts it as a raw ASGI app
        async def __call__(self, scope, receive, send):
            await relay(scope, receive, send)

    async def relay(scope, receive, send):
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        async with state["session"].post(
            upstream, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["session"] = aiohttp.ClientSession()
        yield
        await state["session"].close()

    return Starlette(
        routes=[Route("/v1/chat/completions", Relay(), methods=["POST"])], lifespan=lifespan
    )


@dataclass
class RouterProcess:
    """A `llmgw router` child process (see start_router)."""

    proc: Any
    url: str
    admin_url: str
    log_path: str

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (the router drains), then SIGKILL if it takes longer than `timeout`."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_router(directory, yaml_body: str, *args: str, timeout: float = 60.0) -> RouterProcess:
    """Write `yaml_body` (without listen addresses) under `directory`, start `llmgw
    router` on free ports, and return once /readyz answers 200."""
    import os
    import subprocess
    import time
    from pathlib import Path

    import httpx

    port, admin = free_port(), free_port()
    path = Path(directory) / f"router-{port}.yaml"
    path.write_text(f"listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\n{yaml_body}")
    log_path = str(Path(directory) / f"router-{port}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw.cli", "router", "--config", str(path), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ},
        )
    router = RouterProcess(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}: {router.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(router.admin_url + "/readyz", timeout=1).status_code == 200:
                return router
        time.sleep(0.05)
    router.stop()
    raise RuntimeError(f"router not ready within {timeout}s: {router.log_tail()}")


def _main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or argv[0] != "fast":
        print("usage: python -m llmgw.dev.routerkit fast PORT [GAP_MS]", file=sys.stderr)
        return 2
    import uvloop

    gap = float(argv[2]) / 1000 if len(argv) == 3 else 0.0

    async def serve() -> None:
        server = await fast_upstream(int(argv[1]), gap=gap)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
