"""The simulator's HTTP face: a bare ASGI callable, no framework on the hot path.

Routing is one dict lookup. A completion request is parsed into a Job, handed to the engine
through the driver, and answered from the engine's progress: a stream sends its headers at once
(as vLLM does) and then writes whatever tokens each wake-up brings as one body chunk. A task
per request listens for the client going away and aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import sys
import time
import uuid
from collections.abc import Awaitable, Callable

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from llmgw import config as llmgw_config
from llmgw.simengine import embeddings, kvevents, kvtransfer, lora, responses, tokens, wire
from llmgw.simengine.config import FaultConfig, SimConfig
from llmgw.simengine.driver import Driver
from llmgw.simengine.engine import Engine, EngineParams, Request
from llmgw.simengine.faults import Faults
from llmgw.simengine.metrics import build_registry
from llmgw.simengine.protocol import ApiError, Job, Limits, RequestParser
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 32 << 20
# Left for the last bytes of a response to reach the socket before an injected exit.
EXIT_DELAY_S = 0.05

_SSE_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
    ],
}
_encode = msgspec.json.encode
_RESPONSES_PREFIX = "/v1/responses/"


class _ClientGone(Exception):
    pass


def engine_params(cfg: SimConfig) -> EngineParams:
    return EngineParams(
        max_num_seqs=cfg.max_num_seqs,
        num_blocks=cfg.kv_blocks,
        block_size=cfg.block_size,
        enable_prefix_caching=cfg.enable_prefix_caching,
        ttft=cfg.ttft_ms / 1000,
        prefill_per_token=cfg.prefill_ms_per_token / 1000,
        itl=cfg.itl_ms / 1000,
        itl_per_running=cfg.itl_ms_per_running / 1000,
        kv_transfer=cfg.kv_transfer_ms / 1000,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
    )


def exit_process() -> None:
    """What `exit_after_requests` does by default: die at once, as a crashed engine would."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


class SimApp:
    def __init__(self, cfg: SimConfig, *, on_exit: Callable[[], None] = exit_process):
        self.config = cfg
        names = cfg.served_names
        self.engine = Engine(engine_params(cfg))
        self.driver = Driver(self.engine)
        self.kv_events = kvevents.attach(self.engine, cfg.kv_events_config)
        self.faults = Faults(cfg.faults, seed=cfg.seed)
        self.adapters = lora.Adapters(
            names[0],
            cfg.max_loras,
            cfg.lora_load_seconds,
            max_rank=cfg.max_lora_rank,
            on_demand=cfg.lora_on_demand,
        )
        self.parser = RequestParser(
            Limits(
                frozenset(names),
                cfg.max_model_len,
                cfg.mode,
                cfg.default_output_tokens,
                serves_adapter=self.adapters.serves,
            ),
            seed=cfg.seed,
        )
        self.registry = build_registry(self.engine, names[0], self.adapters)
        self._on_exit = on_exit
        self.store = responses.ResponseStore(cfg.responses_store_size)
        self._background_tasks: set[asyncio.Task] = set()
        self._created = int(time.time())
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(4)
        # What a prefill leg's answer names as this engine (vLLM's kv_transfer_config.engine_id).
        self.engine_id = str(uuid.uuid4())
        self._base_models = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": cfg.model,
                "parent": None,
                "max_model_len": cfg.max_model_len,
                "permission": [],
            }
            for name in names
        ]
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completion},
            "/v1/embeddings": {"POST": self._embeddings},
            "/v1/responses": {"POST": self._responses},
            "/v1/models": {"GET": self._models},
            "/v1/load_lora_adapter": {"POST": self._load_lora},
            "/v1/unload_lora_adapter": {"POST": self._unload_lora},
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
            "/sim/state": {"GET": self._state},
            "/sim/faults": {"GET": self._get_faults, "POST": self._set_faults},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            methods = self._routes.get(scope["path"])
            if methods is None and scope["path"].startswith(_RESPONSES_PREFIX):
                await self._response_by_id(scope, receive, send)
                return
            if methods is None:
                await _send_error(send, ApiError(404, f"no route for {scope['path']}"))
                return
            handler = methods.get(scope["method"])
            if handler is None:
                allowed = ", ".join(methods)
                await _send_error(
                    send, ApiError(405, f"{scope['method']} not allowed; use {allowed}")
                )
                return
            await handler(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.driver.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                for task in list(self._background_tasks):
                    await cancel_and_wait(task)
                await self.driver.stop()
                if self.kv_events is not None:
                    self.kv_events.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- completions ------------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(receive, send, self.parser.chat, "chatcmpl")

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(receive, send, self.parser.completion, "cmpl")

    async def _generate(
        self, receive: Receive, send: Send, parse: Callable[[bytes], Job], id_kind: str
    ) -> None:
        try:
            job = parse(await _read_body(receive))
            injected = self.faults.injected_error()
            if injected is not None:
                raise injected
            await self._adapter_resident(job)
        except ApiError as exc:
            await _send_error(send, exc)
            return
        except _ClientGone:
            return
        await self._run_job(receive, send, job, id_kind)

    async def _adapter_resident(self, job: Job) -> None:
        """A request for an adapter waits while its adapter loads into a slot."""
        if job.model not in self.parser.limits.served_names:
            await self.adapters.acquire(job.model)

    async def _run_job(self, receive: Receive, send: Send, job: Job, id_kind: str) -> None:
        reqs = self._submit(job)
        rid = f"{id_kind}-{self._id_prefix}{next(self._ids):x}"
        watcher = asyncio.ensure_future(self._watch_disconnect(receive, reqs))
        try:
            if job.stream:
                await self._stream(send, job, reqs, rid)
            else:
                await self._unary(send, job, reqs, rid)
        finally:
            watcher.cancel()
            self._abort_unfinished(reqs)
        self._count_completion(reqs)

    def _submit(self, job: Job) -> list[Request]:
        """One engine request per choice: n > 1 runs n sequences, as vLLM's does."""
        cfg = self.config
        faults = self.faults.config
        adapter = None if job.model in self.parser.limits.served_names else job.model
        seed = tokens.salt_seed(job.cache_salt, adapter)
        external = kvtransfer.is_decode_leg(job.kv_transfer)
        hashes = (
            tokens.block_hashes(job.prompt, cfg.block_size, seed)
            if cfg.enable_prefix_caching
            else ()
        )
        reqs = []
        for out in job.outputs:
            req = Request(
                prompt_tokens=job.prompt_tokens,
                max_output=len(out.pieces),
                final_reason=out.final_reason,
                block_hashes=hashes,
                prompt=job.prompt,
                cache_salt=job.cache_salt,
                lora_name=adapter,
                hang_after=faults.hang_after_tokens,
                first_token_delay=faults.slow_first_token_ms / 1000,
                external_prefill=external,
            )
            self.driver.submit(req)
            reqs.append(req)
        return reqs

    def _abort_unfinished(self, reqs: list[Request]) -> None:
        for req in reqs:
            if not req.finished:
                # Cancelled (shutdown past its drain time): free the slot like a disconnect.
                self.driver.abort(req)

    def _count_completion(self, reqs: list[Request]) -> None:
        if reqs[0].finished_reason != "abort" and self.faults.completed():
            log.warning("exit_after_requests reached: exiting now, as a crashed engine would")
            asyncio.get_running_loop().call_later(EXIT_DELAY_S, self._on_exit)

    async def _watch_disconnect(self, receive: Receive, reqs: list[Request]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        for req in reqs:
            self.driver.abort(req)

    @staticmethod
    async def _progress(req: Request, seen: int) -> None:
        """Wait until `req` has more than `seen` tokens or has finished."""
        loop = asyncio.get_running_loop()
        while req.generated <= seen and not req.finished:
            req.waiter = loop.create_future()
            try:
                await req.waiter
            finally:
                req.waiter = None

    @staticmethod
    async def _progress_any(reqs: list[Request], seen: list[int], done: list[bool]) -> None:
        """Wait until a choice not yet `done` has more than its `seen` tokens or has finished."""
        live = [(r, s) for r, s, d in zip(reqs, seen, done, strict=True) if not d]
        if any(r.generated > s or r.finished for r, s in live):
            return
        waiting = [r for r, _ in live]
        # One future for all of them: the driver releases it for whichever moves first.
        fut = asyncio.get_running_loop().create_future()
        for req in waiting:
            req.waiter = fut
        try:
            await fut
        finally:
            for req in waiting:
                req.waiter = None

    async def _stream(self, send: Send, job: Job, reqs: list[Request], rid: str) -> None:
        if len(reqs) > 1:
            await self._stream_choices(send, job, reqs, rid)
            return
        req = reqs[0]
        enc = wire.encoder(job, rid, int(time.time()))
        await send(_SSE_START)
        pending = [enc.role()] if job.kind == "chat" else []
        sent = 0
        while True:
            await self._progress(req, sent)
            if req.finished_reason == "abort":
                return
            n = req.generated
            reason = req.finished_reason
            pending += enc.tokens(sent, n, reason)
            sent = n
            if reason is not None:
                if job.include_usage:
                    pending.append(enc.usage(n, req.cached_tokens))
                pending.append(wire.DONE)
                await send({"type": "http.response.body", "body": b"".join(pending)})
                return
            await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
            pending = []

    async def _stream_choices(self, send: Send, job: Job, reqs: list[Request], rid: str) -> None:
        """n > 1: each event carries one choice, interleaved as the choices progress."""
        created = int(time.time())
        encs = [wire.encoder(job, rid, created, i) for i in range(len(reqs))]
        await send(_SSE_START)
        pending = [enc.role() for enc in encs] if job.kind == "chat" else []
        sent = [0] * len(reqs)
        done = [False] * len(reqs)
        while True:
            await self._progress_any(reqs, sent, done)
            if any(req.finished_reason == "abort" for req in reqs):
                return
            for i, req in enumerate(reqs):
                if done[i]:
                    continue
                n, reason = req.generated, req.finished_reason
                if n > sent[i] or reason is not None:
                    pending += encs[i].tokens(sent[i], n, reason)
                    sent[i] = n
                    done[i] = reason is not None
            if all(done):
                if job.include_usage:
                    pending.append(encs[0].usage(sum(sent), reqs[0].cached_tokens))
                pending.append(wire.DONE)
                await send({"type": "http.response.body", "body": b"".join(pending)})
                return
            if pending:
                body = b"".join(pending)
                await send({"type": "http.response.body", "body": body, "more_body": True})
                pending = []

    async def _wait_all(self, reqs: list[Request]) -> bool:
        """Wait until every choice has finished; False if the request was aborted."""
        for req in reqs:
            while not req.finished:
                await self._progress(req, req.generated)
        return all(req.finished_reason != "abort" for req in reqs)

    async def _unary(self, send: Send, job: Job, reqs: list[Request], rid: str) -> None:
        if not await self._wait_all(reqs):
            return
        body = wire.full_response(
            job,
            rid,
            int(time.time()),
            [req.generated for req in reqs],
            [req.finished_reason for req in reqs],
            reqs[0].cached_tokens,
            self._kv_transfer_answer(job, reqs[0], rid),
        )
        await _send_json(send, 200, body)

    def _kv_transfer_answer(self, job: Job, req: Request, rid: str) -> dict | None:
        """A prefill leg names the blocks its prompt left here; anything else gets null,
        as vLLM's NixlConnector answers a decode leg."""
        if not kvtransfer.is_prefill_leg(job.kv_transfer):
            return None
        computed = req.prompt_tokens + req.generated - 1
        return kvtransfer.prefill_answer(self.engine_id, rid, req.final_blocks, computed)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answered at once: pooling has no decode, and the sim models no prefill for it."""
        cfg = self.config
        try:
            req, prompts = embeddings.parse(
                await _read_body(receive),
                self.parser.limits.served_names,
                cfg.max_model_len,
                cfg.embedding_dim,
            )
            injected = self.faults.injected_error()
            if injected is not None:
                raise injected
        except ApiError as exc:
            await _send_error(send, exc)
            return
        except _ClientGone:
            return
        rid = f"embd-{self._id_prefix}{next(self._ids):x}"
        body = embeddings.response(req, prompts, cfg.embedding_dim, rid, int(time.time()))
        await _send_json(send, 200, body)

    # -- responses ----------------------------------------------------------------------------

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            parsed = responses.parse(await _read_body(receive), self.parser, self.store)
            injected = self.faults.injected_error()
            if injected is not None:
                raise injected
            await self._adapter_resident(parsed.job)
        except ApiError as exc:
            await _send_error(send, exc)
            return
        except _ClientGone:
            return
        resp = responses.Response(parsed)
        if parsed.req.store:
            self.store.put(resp)
        if parsed.req.background:
            resp.status = "queued"
            await _send_json(send, 200, resp.body())
            resp.task = asyncio.create_task(self._background(resp), name=f"sim-{resp.id}")
            self._background_tasks.add(resp.task)
            resp.task.add_done_callback(self._background_tasks.discard)
            return
        reqs = resp.engine_requests = self._submit(parsed.job)
        watcher = asyncio.ensure_future(self._watch_disconnect(receive, reqs))
        try:
            if parsed.job.stream:
                await self._stream_response(send, resp)
            elif await self._wait_all(reqs):
                self._finish_response(resp)
                await _send_json(send, 200, resp.body())
        finally:
            watcher.cancel()
            self._abort_unfinished(reqs)
            resp.engine_requests = []
        self._count_completion(reqs)

    def _finish_response(self, resp: responses.Response) -> None:
        req = resp.engine_requests[0]
        resp.finish(req.generated, req.finished_reason, req.cached_tokens)

    async def _stream_response(self, send: Send, resp: responses.Response) -> None:
        req = resp.engine_requests[0]
        enc = responses.EventEncoder(resp)
        await send(_SSE_START)
        pending = enc.start()
        sent = 0
        while True:
            await self._progress(req, sent)
            if req.finished_reason == "abort":
                resp.status = "cancelled"
                return
            n = req.generated
            pending += enc.tokens(sent, n)
            sent = n
            if req.finished_reason is not None:
                self._finish_response(resp)
                pending += enc.end()
                await send({"type": "http.response.body", "body": b"".join(pending)})
                return
            await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
            pending = []

    async def _background(self, resp: responses.Response) -> None:
        """A `background: true` response runs with no client attached; cancel ends it."""
        reqs = resp.engine_requests = self._submit(resp.parsed.job)
        resp.status = "in_progress"
        try:
            if await self._wait_all(reqs):
                self._finish_response(resp)
            elif resp.status != "cancelled":
                resp.status = "failed"
        finally:
            self._abort_unfinished(reqs)
            resp.engine_requests = []
        self._count_completion(reqs)

    async def _response_by_id(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /v1/responses/{id}, DELETE /v1/responses/{id}, POST .../{id}/cancel."""
        rest = scope["path"][len(_RESPONSES_PREFIX) :]
        response_id, _, action = rest.partition("/")
        method = scope["method"]
        allowed = {"": ("GET", "DELETE"), "cancel": ("POST",)}.get(action)
        if not response_id or allowed is None:
            await _send_error(send, ApiError(404, f"no route for {scope['path']}"))
            return
        if method not in allowed:
            msg = f"{method} not allowed; use {', '.join(allowed)}"
            await _send_error(send, ApiError(405, msg))
            return
        resp = self.store.get(response_id)
        if resp is None:
            await _send_error(send, responses.not_found(response_id))
            return
        if method == "GET":
            await _send_json(send, 200, resp.body())
        elif method == "DELETE":
            self.store.delete(response_id)
            body = {"id": response_id, "object": "response.deleted", "deleted": True}
            await _send_json(send, 200, _encode(body))
        else:
            await self._cancel_response(send, resp)

    async def _cancel_response(self, send: Send, resp: responses.Response) -> None:
        if resp.status not in ("queued", "in_progress") or not resp.parsed.req.background:
            msg = "Cannot cancel a synchronous response."
            await _send_error(send, ApiError(400, msg, param="response_id"))
            return
        resp.status = "cancelled"
        for req in resp.engine_requests:
            self.driver.abort(req)
        await _send_json(send, 200, resp.body())

    # -- everything else ----------------------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        data = self._base_models + self.adapters.models(self._created)
        await _send_json(send, 200, _encode({"object": "list", "data": data}))

    async def _load_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = _json_object(await _read_body(receive))
            text = await self.adapters.load(
                body.get("lora_name"), body.get("lora_path"), bool(body.get("load_inplace"))
            )
        except ApiError as exc:
            await _send_error(send, exc)
            return
        except _ClientGone:
            return
        log.info("LoRA adapter %s loaded from %s", body["lora_name"], body["lora_path"])
        await _send(send, 200, text.encode(), b"text/plain; charset=utf-8")

    async def _unload_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            text = self.adapters.unload(_json_object(await _read_body(receive)).get("lora_name"))
        except ApiError as exc:
            await _send_error(send, exc)
            return
        except _ClientGone:
            return
        await _send(send, 200, text.encode(), b"text/plain; charset=utf-8")

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.driver.failure is not None:
            await _send_error(send, ApiError(503, f"engine dead: {self.driver.failure!r}"))
        else:
            await _send_json(send, 200, b"")

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = generate_latest(self.registry)
        await _send(send, 200, body, CONTENT_TYPE_LATEST.encode())

    async def _state(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.engine.snapshot()
        state["model"] = self.config.served_names[0]
        state["max_num_seqs"] = self.config.max_num_seqs
        state["faults"] = msgspec.to_builtins(self.faults.config)
        await _send_json(send, 200, _encode(state))

    async def _get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, _encode(self.faults.config))

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            raw = await _read_body(receive)
            try:
                data = msgspec.json.decode(raw) if raw.strip() else {}
            except msgspec.DecodeError as exc:
                raise ApiError(400, f"request body is not valid JSON: {exc}") from None
            if not isinstance(data, dict):
                raise ApiError(400, "the body must be a JSON object of fault settings")
            try:
                faults = llmgw_config.convert(FaultConfig, data, source="faults")
            except llmgw_config.ConfigError as exc:
                raise ApiError(400, str(exc)) from None
        except ApiError as exc:
            await _send_error(send, exc)
            return
        except _ClientGone:
            return
        self.faults.replace(faults)
        log.info("faults set: %s", msgspec.to_builtins(faults))
        await _send_json(send, 200, _encode(faults))


def _json_object(raw: bytes) -> dict:
    try:
        data = msgspec.json.decode(raw) if raw.strip() else {}
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    return data


async def _read_body(receive: Receive) -> bytes:
    msg = await receive()
    if msg["type"] == "http.disconnect":
        raise _ClientGone
    body = msg.get("body", b"")
    if not msg.get("more_body", False):
        return body
    parts = [body]
    size = len(body)
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


async def _send(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await _send(send, status, body, b"application/json")


async def _send_error(send: Send, exc: ApiError) -> None:
    await _send_json(send, exc.status, exc.body())
