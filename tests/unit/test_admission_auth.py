"""API keys -> tenants, and every 401 path."""

from __future__ import annotations

import msgspec
import pytest

from llmgw import contracts, keys
from llmgw.router.admission import AdmissionRejected, AdmissionSettings, Controller
from llmgw.router.admission.config import TenantConfig

BANDS = [contracts.Band(name="gold", ceiling=1.0), contracts.Band(name="bronze", ceiling=0.5)]


def t(name: str, *secrets: str, band: str = "gold", **quotas) -> TenantConfig:
    return TenantConfig(
        name=name,
        band=band,
        key_hashes=[keys.hash_key(s) for s in secrets],
        quotas=contracts.Quotas(**quotas),
    )


def controller(*tenants: TenantConfig, anonymous: str = "") -> Controller:
    return Controller(AdmissionSettings(anonymous_tenant=anonymous), BANDS, tenants)


def refused(c: Controller, header: str | None) -> AdmissionRejected:
    with pytest.raises(AdmissionRejected) as err:
        c.authenticate(header)
    assert err.value.status == 401
    assert (b"www-authenticate", b"Bearer") in err.value.headers
    body = msgspec.json.decode(err.value.body())["error"]
    # The body's code and the x-llmgw-reason header say the same thing.
    assert body["code"] == err.value.reason and body["type"] == "invalid_request_error"
    return err.value


def test_keys_map_to_their_tenant():
    c = controller(t("acme", "sk-1", "sk-2"), t("beta", "sk-3", band="bronze"))
    assert c.authenticate("Bearer sk-1").name == "acme"
    assert c.authenticate("bearer  sk-2 ").name == "acme"  # a second key (rotation)
    beta = c.authenticate("Bearer sk-3")
    assert beta.name == "beta" and beta.band == 1


@pytest.mark.parametrize(
    "header, reason",
    [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        ("Bearer", "invalid_api_key"),
        ("Basic c2stMTo=", "invalid_api_key"),
        ("Bearer sk-wrong", "invalid_api_key"),
        ("Bearer " + keys.hash_key("sk-1"), "invalid_api_key"),  # the hash is not the key
    ],
)
def test_missing_and_invalid_keys_get_401(header, reason):
    c = controller(t("acme", "sk-1"))
    e = refused(c, header)
    assert e.reason == reason
    assert b"sk-wrong" not in e.body() and b"c2stMTo" not in e.body()  # never echoed


def test_an_explicit_anonymous_tenant_serves_requests_without_a_key():
    c = controller(t("acme", "sk-1"), t("dev", band="bronze"), anonymous="dev")
    assert c.authenticate(None).name == "dev"
    assert c.authenticate("Bearer sk-1").name == "acme"
    assert refused(c, "Bearer sk-wrong").reason == "invalid_api_key"  # a wrong key is a bug


def test_with_no_tenants_every_request_is_one_anonymous_tenant():
    c = controller()
    assert c.open
    for header in (None, "Bearer whatever", "garbage"):
        tenant = c.authenticate(header)
        assert tenant.name == "anonymous" and tenant.band == len(BANDS) - 1


def test_once_a_tenant_exists_keys_are_required():
    c = controller()
    c.set_tenants([t("acme", "sk-1")])
    assert not c.open
    assert refused(c, None).reason == "missing_api_key"


def test_reconfiguring_drops_old_keys_and_keeps_quota_usage():
    c = controller(t("acme", "sk-1", rpm=2))
    acme = c.authenticate("Bearer sk-1")
    acme.quotas.acquire(1000.0, 1)
    c.set_tenants([t("acme", "sk-new", rpm=2)])
    refused(c, "Bearer sk-1")
    again = c.authenticate("Bearer sk-new")
    assert again.quotas.requests.total == 1
    again.quotas.acquire(1000.5, 1)
    with pytest.raises(AdmissionRejected):
        again.quotas.acquire(1001.0, 1)


def test_tenant_repr_hides_key_hashes():
    c = controller(t("acme", "sk-1"))
    assert "sha256" not in repr(c.directory.by_name["acme"])
