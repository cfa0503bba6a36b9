"""Tenants kept apart at the router, end to end: two `llmgw router` processes that share
nothing, in front of real sim engines.

A stored response is its tenant's alone, through either router: another tenant gets
the 404 an id nobody has gets, for GET, DELETE, cancel and `previous_response_id`.
Calls about stored responses count against the tenant's quotas. A tenant declared
with `cache_isolation` gets a cache salt of its own, so the engine's prefix cache
gives it no hit on another tenant's prompt (and another none on its own), while
its own repeated prompt still hits.
"""

from __future__ import annotations

import http.client

import httpx
import pytest

from llmgw import keys
from llmgw.dev.routerkit import start_router
from llmgw.dev.simkit import start_sim
from llmgw.router.request import salting

pytestmark = pytest.mark.e2e

# name -> (quotas, cache_isolation)
TENANTS = {
    "alice": ("{}", "tenant"),
    "bob": ("{}", "tenant"),
    "carol": ("{}", "none"),
    "dave": ("{}", "none"),
    "erin": ("{rpm: 3}", "none"),
    "frank": ("{}", "key"),
    "gina": ("{rpm: 2}", "none"),
}
# A system prompt of many blocks, which every tenant sends.
SYSTEM = "You are a careful assistant for the accounts team. " * 20


def key(tenant: str, n: int = 0) -> str:
    return f"sk-tenancy-{tenant}-{n}"


def router_yaml(sims) -> str:
    tenants = "\n".join(
        f"  - {{name: {name}, band: default, quotas: {quotas}, cache_isolation: {iso}, "
        f"key_hashes: ['{keys.hash_key(key(name))}', '{keys.hash_key(key(name, 1))}']}}"
        for name, (quotas, iso) in TENANTS.items()
    )
    return (
        "log_level: warning\nadmission: {enabled: false}\n"
        "models: [{name: m}, {name: one}]\n"
        "endpoints:\n"
        f"  - {{id: s0, url: '{sims[0].url}', models: [m, one], engine: sim}}\n"
        f"  - {{id: s1, url: '{sims[1].url}', models: [m], engine: sim}}\n"
        f"tenants:\n{tenants}\n"
    )


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    sims = [start_sim(model="m", served_model_name=["m", "one"], itl_ms=1, ttft_ms=1) for _ in "ab"]
    body = router_yaml(sims)
    started = []
    try:
        for _ in "ab":
            started.append(start_router(tmp_path_factory.mktemp("router"), body))
        yield started
    finally:
        codes = [r.stop() for r in started]
        for s in sims:
            s.stop()
        assert codes == [0] * len(started), [r.log_tail() for r in started]


def client(router, tenant: str, n: int = 0) -> httpx.Client:
    return httpx.Client(
        base_url=router.url, headers={"Authorization": f"Bearer {key(tenant, n)}"}, timeout=30
    )


def create(c: httpx.Client, **extra) -> httpx.Response:
    return c.post(
        "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 4, **extra}
    )


def not_found_body(r: httpx.Response) -> dict:
    assert r.status_code == 404, r.text
    return r.json()


def test_another_tenant_gets_404_for_a_stored_response_through_any_router(routers):
    r1, r2 = routers
    made = create(client(r1, "alice"))
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    nobody = not_found_body(client(r1, "bob").get("/v1/responses/resp_nobody_has_this"))
    for router in routers:  # the router that relayed it, and one that never saw it
        bob = client(router, "bob")
        assert not_found_body(bob.get(f"/v1/responses/{rid}")) == nobody
        assert not_found_body(bob.get(f"/v1/responses/{rid}/input_items")) == nobody
        assert not_found_body(bob.delete(f"/v1/responses/{rid}")) == nobody
        assert not_found_body(bob.post(f"/v1/responses/{rid}/cancel")) == nobody
        # The owner, with either of its keys, still reaches it.
        assert client(router, "alice", 1).get(f"/v1/responses/{rid}").json()["id"] == rid
    # Nor may another tenant continue the conversation (the engine would read it).
    chained = create(client(r2, "bob"), previous_response_id=rid)
    assert chained.status_code == 404 and chained.json()["error"]["param"] == "previous_response_id"
    # A client cannot name the response itself, and so cannot take another's id.
    own = create(client(r1, "bob"), request_id=rid)
    assert own.status_code == 200 and own.json()["id"] != rid
    assert client(r2, "alice").delete(f"/v1/responses/{rid}").json()["deleted"] is True
    assert client(r1, "alice").get(f"/v1/responses/{rid}").status_code == 404


def raw_request(router, method: str, path: str, tenant: str) -> int:
    """A request whose path goes out byte for byte (httpx would remove `..` segments)."""
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {key(tenant)}"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_a_path_that_climbs_out_of_ones_own_response_reaches_nothing(routers):
    # Bob owns one response; paths that start with its id but climb to Alice's (or to
    # any other engine path) must not pass the owner check on the first segment.
    r1, _ = routers
    alices = create(client(r1, "alice")).json()["id"]
    bobs = create(client(r1, "bob")).json()["id"]
    for method, path in [
        ("GET", f"/v1/responses/{bobs}/../{alices}"),
        ("DELETE", f"/v1/responses/{bobs}/../{alices}"),
        ("POST", f"/v1/responses/{bobs}/../{alices}/cancel"),
        ("GET", f"/v1/responses/{bobs}%2F..%2F{alices}"),
        ("GET", f"/v1/responses/{bobs}/%2E%2E/{alices}"),
        ("GET", f"/v1/responses/{bobs}/../../../v1/models"),
        ("GET", f"/v1/responses/{bobs}/extra/segments"),
    ]:
        assert raw_request(r1, method, path, "bob") == 404, (method, path)
    # Alice's response is untouched, and Bob still reaches his own.
    assert client(r1, "alice").get(f"/v1/responses/{alices}").json()["id"] == alices
    assert client(r1, "bob").get(f"/v1/responses/{bobs}").json()["id"] == bobs


def test_a_background_response_is_cancelled_only_by_its_tenant(routers):
    r1, r2 = routers
    made = create(client(r1, "alice"), background=True, max_output_tokens=2000)
    rid = made.json()["id"]
    assert client(r2, "bob").post(f"/v1/responses/{rid}/cancel").status_code == 404
    cancelled = client(r2, "alice").post(f"/v1/responses/{rid}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"


def test_stored_response_calls_count_against_the_tenants_quota(routers):
    erin = client(routers[0], "erin")
    rid = create(erin).json()["id"]  # 1 of 3 this minute
    assert erin.get(f"/v1/responses/{rid}").status_code == 200  # 2
    assert erin.get("/v1/responses/resp_unknown").status_code == 404  # 3: counted too
    limited = erin.get(f"/v1/responses/{rid}")
    assert limited.status_code == 429, limited.text
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["retry-after"]) >= 1


def cached(c: httpx.Client, user: str, **extra) -> int:
    """Prompt tokens the engine found cached for a chat with the shared system prompt."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    r = c.post(
        "/v1/chat/completions",
        json={"model": "one", "messages": messages, "max_tokens": 2, **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_isolated_tenants_share_no_prefix_cache_but_each_hits_its_own(routers):
    r1, r2 = routers
    assert cached(client(r1, "alice"), "first") == 0
    assert cached(client(r2, "alice"), "second") > 0  # its own cache, through either router
    assert cached(client(r1, "bob"), "first") == 0  # the same system prompt: no hit
    assert cached(client(r1, "bob"), "again") > 0
    assert cached(client(r1, "carol"), "first") == 0  # unisolated: not alice's blocks either
    assert cached(client(r1, "dave"), "first") > 0  # but shares carol's, as before


def test_a_client_cannot_pick_another_tenants_salt(routers):
    r1, _ = routers
    # Whoever knows how salts are derived and alice's name can compute hers, but no
    # tenant may send a salt in the router's namespace, isolated or not.
    hers = salting.salt(b"alice", b"")
    for tenant in ("bob", "carol"):
        refused = client(r1, tenant).post(
            "/v1/chat/completions",
            json={
                "model": "one",
                "messages": [{"role": "user", "content": "x"}],
                "cache_salt": hers,
            },
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"
    # A salt of its own subdivides a tenant's cache; the same salt from another isolated
    # tenant is hashed with that tenant's name, so it reaches nothing of alice's.
    assert cached(client(r1, "alice"), "mine", cache_salt="project-x") == 0
    assert cached(client(r1, "alice"), "mine 2", cache_salt="project-x") > 0
    assert cached(client(r1, "bob"), "mine 3", cache_salt="project-x") == 0


def test_key_isolation_keeps_each_key_apart(routers):
    r1, _ = routers
    assert cached(client(r1, "frank", 0), "a") == 0
    assert cached(client(r1, "frank", 0), "b") > 0
    assert cached(client(r1, "frank", 1), "a") == 0


def test_a_request_the_tenant_binding_refuses_costs_no_quota(routers):
    # Refused before admission: neither queued nor counted against the tenant's rpm.
    r1, _ = routers
    gina = client(r1, "gina")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(3):
        refused = gina.post("/v1/chat/completions", json={**chat, "cache_salt": "llmgw-x"})
        assert refused.status_code == 400, refused.text
        stranger = create(gina, previous_response_id="resp_nobody_has_this")
        assert stranger.status_code == 404, stranger.text
    assert gina.post("/v1/chat/completions", json=chat).status_code == 200
