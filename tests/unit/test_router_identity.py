"""A router's id follows from its NATS certificate, and routers are counted by the key
NATS binds to that certificate.

NATS lets the identity `router-1` put only its own presence key and publish only its own
demand subject (tests/integration/test_nats_mtls.py shows a real server refusing the
rest), so a router connecting with that certificate must be `router-1`: unset, the id
comes from the certificate; configured otherwise, the router refuses to start.
"""

from __future__ import annotations

import pytest

from llmgw import certs, cli, tlsconfig
from llmgw import config as cfg
from llmgw import contracts as c
from llmgw.router import config as rc
from llmgw.router.controlplane.presence import Presence
from llmgw.router.controlplane.watch import Entry


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    certs.init(d, ["node-a"], routers=2)
    return d


def _config(cert_dir, identity: str, router_id: str = "") -> rc.RouterConfig:
    return rc.RouterConfig(
        nats_url="tls://127.0.0.1:4222",
        nats_tls=tlsconfig.from_certs_dir(cert_dir, identity),
        router_id=router_id,
    )


def test_the_router_id_comes_from_the_certificate_when_unset(cert_dir):
    assert rc.resolve_router_id(_config(cert_dir, "router-2")).router_id == "router-2"
    # Configured the same: kept (what `llmgw dev --secure` writes for router-N).
    assert rc.resolve_router_id(_config(cert_dir, "router-2", "router-2")).router_id == "router-2"
    assert rc.validate(_config(cert_dir, "router-2", "router-2")) == []


def test_a_router_id_other_than_the_certificates_refuses_to_start(cert_dir, tmp_path, capsys):
    path = tmp_path / "router.yaml"
    tls = tlsconfig.from_certs_dir(cert_dir, "router-1")
    path.write_text(
        "nats_url: tls://127.0.0.1:4222\nrouter_id: router-2\n"
        f"nats_tls: {{ca: {tls.ca}, cert: {tls.cert}, key: {tls.key}}}\n"
    )
    assert cli.main(["router", "--config", str(path), "--check"]) == 2
    err = capsys.readouterr().err
    assert "router_id = 'router-2'" in err and "names router 'router-1'" in err

    # Built in code rather than from a file, the service refuses too: it resolves its id
    # with resolve_router_id before anything starts.
    with pytest.raises(cfg.ConfigError, match="router_id = 'router-2'.*names router 'router-1'"):
        rc.resolve_router_id(_config(cert_dir, "router-1", "router-2"))


def test_a_certificate_that_is_not_a_routers_is_refused(cert_dir):
    problems = rc.validate(_config(cert_dir, "agent-node-a"))
    assert any("certificate of 'agent-node-a', not of a router" in p for p in problems)
    with pytest.raises(cfg.ConfigError, match="not of a router"):
        rc.resolve_router_id(_config(cert_dir, "agent-node-a"))


def test_routers_are_counted_by_their_key_not_by_the_id_their_record_claims():
    """NATS binds a router to its own presence key, not to what it writes there: router-3
    writing `router_id: router-2` under its own key is still a third router, and
    router-2 leaving does not take router-3 with it."""
    counts: list[int] = []
    presence = Presence(None, "router-1", counts.append, clock=lambda: 100.0, wall=lambda: 50.0)
    watcher = presence.watcher  # what the bucket watch calls

    def record(key: str, claims: str) -> Entry:
        return Entry(key, c.encode(c.RouterPresence(router_id=claims)), 50.0)

    watcher.on_snapshot({k: record(k, k) for k in ("router-1", "router-2")})
    assert counts[-1] == 2
    watcher.on_put(record("router-3", claims="router-2"))
    assert counts[-1] == 3
    watcher.on_delete("router-2")
    assert counts[-1] == 2
    watcher.on_put(Entry("router-4", b"not a presence record", 50.0))  # still a router
    assert counts[-1] == 3
