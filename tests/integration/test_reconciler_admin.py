"""The admin listener's probes and API errors, in process (ASGI) on a real or absent database."""

from __future__ import annotations

import httpx

from llmgw.reconciler.api import admin, auth
from llmgw.reconciler.store import schema

# These tests are about probes and errors; who may call the API is test_operator_api_auth's.
OPEN = auth.Authorizer(auth.AUTH_NONE, [])


async def get(app, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
        return await client.get(path)


async def test_probes_and_bad_parameters_on_a_live_database(database_url):
    engine = schema.make_engine(database_url)
    await schema.upgrade(engine)
    app = admin.build_app(engine, admin.Role("r1", "standby"), OPEN)
    try:
        ready = await get(app, "/readyz")
        assert ready.status_code == 200 and ready.json()["role"] == "standby"
        assert (await get(app, "/api/nodes")).json() == []
        bad = await get(app, "/api/events?from_seq=abc")
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == (
            "query parameter from_seq='abc': expected an integer"
        )
        missing = await get(app, "/api/explain/nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
        assert (await get(app, "/api/nothing")).status_code == 404
        metrics = await get(app, "/metrics")
        assert "llmgw_reconciler_leader " in metrics.text
    finally:
        await engine.dispose()


async def test_readiness_fails_and_reads_say_why_when_the_database_is_unreachable():
    engine = schema.make_engine("postgresql+asyncpg://postgres@127.0.0.1:1/none")
    app = admin.build_app(engine, admin.Role("r1", "standby"), OPEN)
    try:
        ready = await get(app, "/readyz")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        nodes = await get(app, "/api/nodes")
        assert nodes.status_code == 503
        assert nodes.json()["error"]["message"].startswith("database unavailable")
        assert (await get(app, "/healthz")).status_code == 200  # alive, just not ready
    finally:
        await engine.dispose()
