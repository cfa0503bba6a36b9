"""Authentication comes first: a request without a valid key gets 401 whatever its body.

A router with tenants in front of a fake engine, over real sockets. OpenAI answers a
missing or wrong key with 401 before it looks at the body; so does the router, since
it authenticates on the headers before reading the body.
"""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from llmgw import contracts, keys
from llmgw.dev.routerkit import config_for, fake_engines, running_router
from llmgw.router.admission.config import AdmissionSettings, TenantConfig

KEY = "sk-auth-test-acme"
WRONG = "sk-auth-test-wrong"
LIMIT = 2048
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}

BODIES = {
    "malformed json": (json.dumps(CHAT)[:-3].encode(), 400, "invalid_json"),
    "unknown model": (json.dumps({**CHAT, "model": "ghost"}).encode(), 404, "model_not_found"),
    "oversized": (
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 4000}]}).encode(),
        413,
        "body_too_large",
    ),
}
NO_KEY = {}
BAD_KEY = {"Authorization": f"Bearer {WRONG}"}
GOOD_KEY = {"Authorization": f"Bearer {KEY}"}


def tenants_config(engine, **admission):
    return config_for(
        [engine],
        max_body_bytes=LIMIT,
        admission=AdmissionSettings(**admission),
        tenants=[TenantConfig(name="acme", band="default", key_hashes=[keys.hash_key(KEY)])],
        bands=[contracts.Band(name="default")],
    )


async def post(http, url, data, headers, path="/v1/chat/completions"):
    async with http.post(url + path, data=data, headers=headers) as resp:
        return resp.status, resp.headers, await resp.read()


async def test_no_key_or_a_wrong_key_gets_401_whatever_the_body(caplog):
    caplog.set_level(logging.DEBUG)
    async with fake_engines("a") as (a,), aiohttp.ClientSession() as http:
        async with running_router(tenants_config(a)) as r:
            for name, (body, _, _) in BODIES.items():
                for headers, reason in ((NO_KEY, "missing_api_key"), (BAD_KEY, "invalid_api_key")):
                    status, h, raw = await post(http, r.url, body, headers)
                    assert (status, h["x-llmgw-reason"]) == (401, reason), name
                    assert h["www-authenticate"] == "Bearer"
                    error = json.loads(raw)["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert (error["type"], error["code"]) == ("invalid_request_error", reason)

                    # A body sent in chunks, with no length declared: refused all the same.
                    async def chunks(body=body):
                        for i in range(0, len(body), 1000):
                            yield body[i : i + 1000]

                    status, _, _ = await post(http, r.url, chunks(), headers)
                    assert status == 401, name
            # The connections the refused bodies were sent on still serve the next request.
            status, _, _ = await post(http, r.url, json.dumps(CHAT), GOOD_KEY)
            assert status == 200
    assert len(a.seen) == 1
    assert WRONG not in caplog.text and KEY not in caplog.text


async def test_an_authenticated_bad_request_gets_its_own_error():
    async with fake_engines("a") as (a,), aiohttp.ClientSession() as http:
        async with running_router(tenants_config(a)) as r:
            for name, (body, status, reason) in BODIES.items():
                got, h, raw = await post(http, r.url, body, GOOD_KEY)
                assert (got, h["x-llmgw-reason"]) == (status, reason), name
                assert json.loads(raw)["error"]["code"] == reason
            # Listing models needs a key like every other route.
            for path in ("/v1/models", "/v1/models/m"):
                for headers, reason in ((NO_KEY, "missing_api_key"), (BAD_KEY, "invalid_api_key")):
                    async with http.get(r.url + path, headers=headers) as resp:
                        assert (resp.status, resp.headers["x-llmgw-reason"]) == (401, reason)
                        assert resp.headers["www-authenticate"] == "Bearer"
            async with http.get(r.url + "/v1/models", headers=GOOD_KEY) as resp:
                assert resp.status == 200
                assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
            async with http.get(r.url + "/v1/models/m", headers=GOOD_KEY) as resp:
                assert (resp.status, (await resp.json())["id"]) == (200, "m")
    assert a.seen == []


@pytest.mark.parametrize("mode", ["anonymous tenant", "no tenants"])
async def test_without_a_key_requirement_a_bad_body_gets_its_own_error(mode):
    async with fake_engines("a") as (a,), aiohttp.ClientSession() as http:
        if mode == "anonymous tenant":
            cfg = tenants_config(a, anonymous_tenant="acme")
        else:
            cfg = config_for([a], max_body_bytes=LIMIT)
        async with running_router(cfg) as r:
            body, status, reason = BODIES["malformed json"]
            got, h, _ = await post(http, r.url, body, NO_KEY)
            assert (got, h["x-llmgw-reason"]) == (status, reason)
            ok, _, _ = await post(http, r.url, json.dumps(CHAT), NO_KEY)
            assert ok == 200
            if mode == "anonymous tenant":  # a wrong key is still refused
                got, _, _ = await post(http, r.url, body, BAD_KEY)
                assert got == 401
