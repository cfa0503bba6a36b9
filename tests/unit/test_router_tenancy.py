"""What a tenant changes in the body the router sends upstream (request/tenancy.py), and
the ids and salts it derives (ownership.py, salting.py): pure logic, no sockets."""

from __future__ import annotations

import json

import pytest

from llmgw import contracts, keys
from llmgw.router.admission.quotas import TenantQuotas
from llmgw.router.admission.tenants import Tenant
from llmgw.router.http.errors import RouterError
from llmgw.router.request import body as rq
from llmgw.router.request import ownership, salting, tenancy


def tenant(name: str, isolation: str = "none") -> Tenant:
    quotas = TenantQuotas(contracts.Quotas())
    return Tenant(name, 0, contracts.Quotas(), quotas, [], isolation, owner=name)


def auth(key: str) -> dict[bytes, bytes]:
    return {b"authorization": f"Bearer {key}".encode()}


def minted(response_id: bytes, owner: str) -> bool:
    return ownership.minted_for(owner, response_id)


def bound(kind: str, body: dict, who: Tenant, headers=None, owns=minted):
    req = rq.parse(kind, json.dumps(body).encode())
    tenancy.bind(req, who, headers or {}, owns)
    return req, json.loads(req.body)


def test_a_minted_id_is_its_tenants_alone():
    rid = ownership.mint("alice")
    assert rid.startswith(b"resp_") and rid != ownership.mint("alice")
    assert ownership.minted_for("alice", rid)
    assert not ownership.minted_for("bob", rid)
    assert not ownership.minted_for("alice", rid[:-1] + b"0" if rid[-1:] != b"0" else b"1")
    assert not ownership.minted_for("alice", b"resp_" + b"0" * 56)
    assert not ownership.minted_for("alice", b"resp_short")


def test_a_responses_create_gets_an_id_of_its_tenant_whatever_the_client_sent():
    req, sent = bound(
        "responses", {"model": "m", "input": "hi", "request_id": "resp_x"}, tenant("a")
    )
    assert ownership.minted_for("a", sent["request_id"].encode())
    assert sent["input"] == "hi" and req.cache_salt is None and "cache_salt" not in sent


def test_previous_response_id_must_be_the_tenants_own():
    mine = ownership.mint("a").decode()
    _, sent = bound(
        "responses", {"model": "m", "input": "x", "previous_response_id": mine}, tenant("a")
    )
    assert sent["previous_response_id"] == mine
    with pytest.raises(RouterError) as err:
        bound("responses", {"model": "m", "input": "x", "previous_response_id": mine}, tenant("b"))
    assert (err.value.status, err.value.param) == (404, "previous_response_id")

    # One the engine named itself is the tenant's when this router remembers it as such.
    def remembered(rid: bytes, owner: str) -> bool:
        return (rid, owner) == (b"resp_engine", "b")

    body = {"model": "m", "input": "x", "previous_response_id": "resp_engine"}
    assert bound("responses", body, tenant("b"), owns=remembered)[1]["input"] == "x"
    with pytest.raises(RouterError):
        bound("responses", {**body, "previous_response_id": 7}, tenant("b"), owns=remembered)


def test_an_unisolated_tenants_chat_goes_upstream_byte_for_byte():
    body = b'{"model": "m", "messages": [], "temperature": 1.0000, "cache_salt": "own"}'
    req = rq.parse("chat", body)
    tenancy.bind(req, tenant("a"), {}, lambda _id, _o: False)
    assert req.body is body and req.cache_salt == "own"


def test_an_isolated_tenants_salt_is_derived_and_a_client_salt_hashed_in():
    alice, bob = tenant("alice", "tenant"), tenant("bob", "tenant")
    req, sent = bound("chat", {"model": "m", "messages": []}, alice)
    assert sent["cache_salt"] == req.cache_salt == salting.salt(b"alice", b"")
    assert bound("completions", {"model": "m", "prompt": "p"}, alice)[1]["cache_salt"] == (
        req.cache_salt
    )
    own = bound("chat", {"model": "m", "messages": [], "cache_salt": "x"}, alice)[1]["cache_salt"]
    bobs = bound("chat", {"model": "m", "messages": [], "cache_salt": "x"}, bob)[1]["cache_salt"]
    assert len({own, bobs, req.cache_salt}) == 3
    assert len(own) <= 128 and not set("@/\\\0") & set(own)
    # Kinds whose engines do not salt their cache are left alone.
    req = rq.parse("embeddings", b'{"model": "m", "input": "x"}')
    tenancy.bind(req, alice, {}, lambda _id, _o: False)
    assert req.cache_salt is None and b"cache_salt" not in req.body


def test_key_isolation_derives_a_salt_per_key():
    frank = tenant("frank", "key")
    one = bound("chat", {"model": "m", "messages": []}, frank, auth("sk-1"))[1]["cache_salt"]
    again = bound("chat", {"model": "m", "messages": []}, frank, auth("sk-1"))[1]["cache_salt"]
    two = bound("chat", {"model": "m", "messages": []}, frank, auth("sk-2"))[1]["cache_salt"]
    assert one == again != two
    assert one == salting.salt(b"frank\0" + keys.hash_key("sk-1").encode(), b"")


@pytest.mark.parametrize("isolation", ["none", "tenant"])
def test_no_client_may_send_a_salt_in_the_routers_namespace(isolation):
    with pytest.raises(RouterError) as err:
        bound(
            "chat", {"model": "m", "messages": [], "cache_salt": "llmgw-x"}, tenant("a", isolation)
        )
    assert (err.value.status, err.value.param) == (400, "cache_salt")
