"""The OpenAI surface as real clients use it: the openai SDK (sync and async),
langchain-openai and litellm, against a router in front of fake engines.

Sync clients run in a worker thread: the router and the engines share this
test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import openai
import pytest

from llmgw import contracts, keys
from llmgw.dev.routerkit import config_for, fake_engines, response_events, running_router
from llmgw.router import config as rc
from llmgw.router.admission.config import AdmissionSettings, TenantConfig

HI = [{"role": "user", "content": "hello"}]
# Nothing here tests a deadline: generous ones keep a busy machine from failing a test.
PATIENT = rc.ModelDefaults(
    deadlines=contracts.DeadlineSpec(connect=10, headers=60, first_token=60, idle=60, total=120)
)


def relaxed(engines, **kw):
    kw.setdefault("model_defaults", PATIENT)
    return config_for(engines, **kw)


KEY = "sk-clients"


def sdk(url: str, key: str = "none", **kw) -> openai.OpenAI:
    kw.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=url + "/v1", api_key=key, **kw)


def async_sdk(url: str, key: str = "none", **kw) -> openai.AsyncOpenAI:
    kw.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, **kw)


# ------------------------------------------------------------------ Responses API


async def test_responses_create_stream_retrieve_and_delete_with_the_sdk():
    async with fake_engines("a", "b") as engines:
        async with running_router(relaxed(engines)) as r:
            client = async_sdk(r.url)
            made = await client.responses.create(model="m", input="hi")
            assert made.output_text.startswith("from ") and made.usage.output_tokens == 3
            # Sync too, and streamed: the stream ends with response.completed, no [DONE].
            stream = await asyncio.to_thread(
                lambda: list(sdk(r.url).responses.create(model="m", input="hi", stream=True))
            )
            assert [e.type for e in stream][-1] == "response.completed"
            # A stored response is fetched from, and deleted at, the engine that made it,
            # without asking the other one.
            maker = next(e for e in engines if made.id in e.stored)
            got = await client.responses.retrieve(made.id)
            assert got.id == made.id
            await client.responses.delete(made.id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(made.id)
    other = next(e for e in engines if e is not maker)
    by_id = f"/v1/responses/{made.id}"
    assert [s.path for s in maker.seen].count(by_id) == 3
    assert [s.path for s in other.seen].count(by_id) == 1  # asked only once it was gone


async def test_a_stored_response_made_through_another_router_is_found_by_asking_around():
    async with fake_engines("a", "b") as (a, b):
        b.stored["resp_elsewhere"] = {"id": "resp_elsewhere", "object": "response"}
        async with running_router(relaxed([a, b])) as r:
            got = await async_sdk(r.url).responses.retrieve("resp_elsewhere")
            with pytest.raises(openai.NotFoundError) as err:
                await async_sdk(r.url).responses.retrieve("resp_nowhere")
    assert got.id == "resp_elsewhere"
    assert err.value.response.headers["x-request-id"]


@pytest.mark.parametrize("cut", ["closed after two events", "connection dropped"])
async def test_a_responses_stream_cut_short_raises_in_the_sdk_instead_of_ending_quietly(cut):
    answer = {"id": "resp_1", "output": [{"content": [{"text": "x"}]}]}
    kw = {"events": response_events(answer)[:2]} if cut.startswith("closed") else {"drop_after": 2}
    async with fake_engines("a", **kw) as (a,):
        async with running_router(relaxed([a])) as r:
            seen = []
            with pytest.raises(openai.APIError) as err:
                async for event in await async_sdk(r.url).responses.create(
                    model="m", input="hi", stream=True
                ):
                    seen.append(event.type)
    assert seen == ["response.created", "response.in_progress"]
    expected = "ended the stream early" if cut.startswith("closed") else "broke the connection"
    assert expected in str(err.value)
    assert "a" not in str(err.value).split()  # no endpoint id for the client


async def test_langchain_chat_and_responses_api_and_embeddings():
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    async with fake_engines("a") as (a,):
        async with running_router(relaxed([a])) as r:
            kw = {"model": "m", "base_url": r.url + "/v1", "api_key": "none", "max_retries": 0}
            chat = await ChatOpenAI(**kw).ainvoke("hi")
            chunks = [c.content async for c in ChatOpenAI(**kw, streaming=True).astream("hi")]
            responses = await ChatOpenAI(**kw, use_responses_api=True).ainvoke("hi")
            streamed = [c async for c in ChatOpenAI(**kw, use_responses_api=True).astream("hi")]
            emb = await OpenAIEmbeddings(
                model="m",
                base_url=r.url + "/v1",
                api_key="none",
                check_embedding_ctx_length=False,
                max_retries=0,
            ).aembed_query("hi")
    assert chat.content == "from a"
    assert "".join(chunks) == "t0 t1 t2 t3 "
    assert responses.text == "from a" if isinstance(responses.text, str) else responses.text()
    assert streamed
    assert emb == [0.1, 0.2]
    assert [s.path for s in a.seen].count("/v1/responses") == 2


@pytest.fixture
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return pytest.importorskip("litellm")


async def test_litellm_as_a_client_chat_responses_and_embeddings(litellm):
    async with fake_engines("a") as (a,):
        async with running_router(relaxed([a])) as r:
            kw = {"api_base": r.url + "/v1", "api_key": "none"}
            chat = await litellm.acompletion(model="openai/m", messages=HI, **kw)
            resp = await litellm.aresponses(model="openai/m", input="hi", **kw)
            emb = await litellm.aembedding(model="openai/m", input=["hi"], **kw)
            sync = await asyncio.to_thread(
                lambda: (
                    litellm.completion(model="openai/m", messages=HI, **kw),
                    litellm.responses(model="openai/m", input="hi", **kw),
                )
            )
    assert chat.choices[0].message.content == "from a"
    assert sync[0].choices[0].message.content == "from a"
    assert sync[1].output[0].content[0].text == "from a"
    assert resp.output[0].content[0].text == "from a"
    assert emb.data[0]["embedding"] == [0.1, 0.2]


# ------------------------------------------------------------------ /v1/models


async def test_models_list_and_retrieve_with_max_model_len_stable_created_and_owner():
    async with fake_engines("a", max_model_len=2048) as (a,):
        cfg = relaxed(
            [a], models=[rc.ModelConfig(name="m", aliases=["m-latest"], owned_by="acme-labs")]
        )
        async with running_router(cfg) as r:
            client = async_sdk(r.url)
            first = [m async for m in client.models.list()]
            await asyncio.sleep(1.1)
            again = [m async for m in client.models.list()]
            one = await asyncio.to_thread(lambda: sdk(r.url).models.retrieve("m-latest"))
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("ghost")
    assert [m.id for m in first] == ["m", "m-latest"]
    assert [m.created for m in first] == [m.created for m in again]
    assert {m.owned_by for m in first} == {"acme-labs"}
    assert first[0].model_extra["max_model_len"] == 2048
    assert (one.id, one.model_extra["root"], one.model_extra["max_model_len"]) == (
        "m-latest",
        "m",
        2048,
    )


# ------------------------------------------------------------------ engines' 429


@pytest.mark.parametrize("status", [429, 408])
async def test_an_engines_429_or_408_reaches_the_sdk_with_the_soonest_retry_after(status):
    async with fake_engines("a", "b", status=status) as (a, b):
        a.retry_after, b.retry_after = "7", "3"
        async with running_router(relaxed([a, b])) as r:
            error = openai.RateLimitError if status == 429 else openai.APIStatusError
            with pytest.raises(error) as err:
                await async_sdk(r.url).chat.completions.create(model="m", messages=HI)
            with pytest.raises(error):
                await asyncio.to_thread(lambda: sdk(r.url).embeddings.create(model="m", input="hi"))
    got = err.value
    assert got.status_code == status
    assert got.response.headers["retry-after"] == "3"
    message = got.body["message"]
    assert "fails" not in message and " a " not in f" {message} " and " b " not in message


async def test_the_sdk_retries_an_engines_429_and_succeeds_when_the_engine_recovers():
    async with fake_engines("a", status=429) as (a,):
        a.retry_after = "0"
        async with running_router(relaxed([a])) as r:
            client = async_sdk(r.url, max_retries=2)

            async def recover():
                while len(a.seen) < 1:
                    await asyncio.sleep(0.01)
                a.status = 200

            fixer = asyncio.create_task(recover())
            got = await client.with_options(max_retries=3).chat.completions.create(
                model="m", messages=HI
            )
            await fixer
    assert got.choices[0].message.content == "from a"


# ------------------------------------------------------------------ vLLM's other endpoints


async def test_vllm_endpoints_are_routed_by_the_model_in_the_body():
    async with fake_engines("a") as (a,):
        cfg = relaxed([a], models=[rc.ModelConfig(name="m", aliases=["alias"])])
        async with running_router(cfg) as r, aiohttp.ClientSession() as http:
            answers = {}
            for path in ("/tokenize", "/detokenize", "/v1/rerank", "/rerank", "/v1/score"):
                async with http.post(
                    r.url + path, json={"model": "alias", "prompt": "x", "query": "q"}
                ) as resp:
                    answers[path] = (resp.status, await resp.json())
            async with http.post(r.url + "/pooling", json={"model": "ghost"}) as resp:
                ghost = resp.status
            text = await async_sdk(r.url).audio.transcriptions.create(
                model="alias", file=("a.wav", b"RIFFfake", "audio/wav")
            )
            sync_text = await asyncio.to_thread(
                lambda: sdk(r.url).audio.transcriptions.create(
                    model="m", file=("a.wav", b"RIFF", "audio/wav")
                )
            )
    for path, (status, body) in answers.items():
        assert status == 200 and body == {"path": path, "model": "m", "by": "a"}
    assert ghost == 404
    assert text.text == sync_text.text == "heard by a"
    heard = [s for s in a.seen if s.path == "/v1/audio/transcriptions"]
    assert heard[0].body["model"] == "m" and heard[0].body["file"] == "RIFFfake"


async def test_a_catalog_can_say_which_kinds_a_model_serves():
    async with fake_engines("a") as (a,):
        cfg = relaxed([a], models=[rc.ModelConfig(name="m", api_kinds=["embeddings"])])
        async with running_router(cfg) as r:
            client = async_sdk(r.url)
            emb = await client.embeddings.create(model="m", input="hi")
            with pytest.raises(openai.NotFoundError) as err:
                await client.chat.completions.create(model="m", messages=HI)
    assert emb.data[0].embedding == [0.1, 0.2]
    assert err.value.body["code"] == "model_not_found"


# ------------------------------------------------------------------ not stricter than vLLM


async def test_values_only_the_engine_judges_reach_it_through_the_sdk():
    async with fake_engines("a") as (a,):
        async with running_router(relaxed([a])) as r:
            client = async_sdk(r.url)
            await client.chat.completions.create(
                model="m", messages=HI, temperature=2.5, top_logprobs=21, logprobs=True
            )
            await client.chat.completions.create(
                model="m", messages=HI, extra_body={"max_tokens": 10.0}
            )
            await client.embeddings.create(model="m", input="", extra_body={"messages": HI})
            await client.completions.create(
                model="m", prompt=None, extra_body={"prompt_embeds": "AAAA"}
            )
    assert [s.body.get("temperature") for s in a.seen][:1] == [2.5]
    assert a.seen[1].body["max_tokens"] == 10.0
    assert len(a.seen) == 4


# ------------------------------------------------------------------ headers and CORS


async def test_upstream_headers_secrets_and_trace_context_reach_the_engine(monkeypatch):
    monkeypatch.setenv("LLMGW_TEST_ENGINE_KEY", "Bearer sk-engine")
    async with fake_engines("a") as (a,):
        model = rc.ModelConfig(
            name="m", upstream=contracts.UpstreamSpec(headers={"x-tier": "gold"})
        )
        cfg = relaxed([a], models=[model])
        cfg.endpoints[0].upstream = contracts.UpstreamSpec(
            secret_headers={"Authorization": "LLMGW_TEST_ENGINE_KEY"}
        )
        async with running_router(cfg) as r:
            trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            await async_sdk(r.url, key="sk-client").chat.completions.create(
                model="m",
                messages=HI,
                extra_headers={"traceparent": trace, "tracestate": "v=1"},
            )
    seen = a.seen[0].headers
    assert seen["authorization"] == "Bearer sk-engine"  # the engine's key, never the client's
    assert seen["x-tier"] == "gold"
    assert (seen["traceparent"], seen["tracestate"]) == (trace, "v=1")


async def test_a_missing_secret_is_a_config_problem():
    cfg = relaxed([], models=[rc.ModelConfig(name="m")])
    cfg.models[0].upstream = contracts.UpstreamSpec(secret_headers={"Authorization": "NOPE_X"})
    problems = rc.validate(cfg)
    assert any("NOPE_X" in p for p in problems)


async def test_cors_is_off_by_default_and_answers_preflights_when_on():
    async with fake_engines("a") as (a,), aiohttp.ClientSession() as http:
        preflight = {
            "origin": "https://app.example",
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        }
        async with running_router(relaxed([a])) as r:
            async with http.options(r.url + "/v1/chat/completions", headers=preflight) as resp:
                off = (resp.status, resp.headers.get("access-control-allow-origin"))
        cfg = relaxed([a], cors=rc.CorsConfig(allow_origins=["https://app.example"]))
        async with running_router(cfg) as r:
            async with http.options(r.url + "/v1/chat/completions", headers=preflight) as resp:
                on = resp.status, resp.headers.copy()
            async with http.post(
                r.url + "/v1/chat/completions",
                json={"model": "m", "messages": HI},
                headers={"origin": "https://app.example"},
            ) as resp:
                served = resp.status, resp.headers.copy()
            async with http.get(
                r.url + "/v1/models", headers={"origin": "https://evil.example"}
            ) as resp:
                other = resp.headers.get("access-control-allow-origin")
    assert off[1] is None and off[0] in (404, 405)
    assert on[0] == 204 and on[1]["x-request-id"]
    assert on[1]["access-control-allow-origin"] == "https://app.example"
    assert on[1]["access-control-allow-headers"] == "authorization, content-type"
    assert served[0] == 200 and served[1]["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in served[1]["access-control-expose-headers"]
    assert other is None


# ------------------------------------------------------------------ item 7


async def test_an_alias_with_a_number_no_decoder_takes_is_relayed_byte_for_byte():
    async with fake_engines("a") as (a,):
        cfg = relaxed([a], models=[rc.ModelConfig(name="m", aliases=["alias"])])
        async with running_router(cfg) as r, aiohttp.ClientSession() as http:
            body = b'{"model":"alias","messages":[{"role":"user","content":"x"}],"x":1e999}'
            async with http.post(r.url + "/v1/chat/completions", data=body) as resp:
                status = resp.status
    assert status == 200
    assert a.seen[0].body["model"] == "m"


@pytest.mark.parametrize(("method", "path"), [("GET", "/nowhere"), ("DELETE", "/v1/models")])
async def test_every_answer_carries_a_request_id(method, path):
    async with fake_engines("a") as (a,):
        async with running_router(relaxed([a])) as r, aiohttp.ClientSession() as http:
            async with http.request(method, r.url + path) as resp:
                status, rid = resp.status, resp.headers.get("x-request-id")
                body = json.loads(await resp.read())
    assert status in (404, 405) and rid
    assert set(body["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------ rate-limit headers


async def test_admitted_responses_carry_openais_rate_limit_headers():
    async with fake_engines("a") as (a,):
        cfg = relaxed(
            [a],
            admission=AdmissionSettings(),
            tenants=[
                TenantConfig(
                    name="acme",
                    band="default",
                    key_hashes=[keys.hash_key(KEY)],
                    quotas=contracts.Quotas(rpm=10, tpm=100_000),
                )
            ],
            bands=[contracts.Band(name="default")],
        )
        async with running_router(cfg) as r:
            client = async_sdk(r.url, key=KEY)
            first = await client.chat.completions.with_raw_response.create(
                model="m", messages=HI, max_tokens=10
            )
            second = await asyncio.to_thread(
                lambda: sdk(r.url, key=KEY).chat.completions.with_raw_response.create(
                    model="m", messages=HI, max_tokens=10
                )
            )
    h1, h2 = first.headers, second.headers
    assert h1["x-ratelimit-limit-requests"] == "10"
    assert (h1["x-ratelimit-remaining-requests"], h2["x-ratelimit-remaining-requests"]) == (
        "9",
        "8",
    )
    assert h1["x-ratelimit-limit-tokens"] == "100000"
    assert int(h2["x-ratelimit-remaining-tokens"]) < 100_000
    assert h1["x-ratelimit-reset-requests"].endswith("s")
