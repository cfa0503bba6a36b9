"""`llmgw certs`, `llmgw nats-config` and the TLS config section, without a server.

The permission tests match subjects the way nats-server does (`*` one token,
`>` the rest) and check what each identity can NOT reach; the integration
test (tests/integration/test_nats_mtls.py) shows a real server agrees.
"""

from __future__ import annotations

import stat

import msgspec
import pytest
import yaml
from cryptography import x509

from llmgw import certs, cli, config, natsconfig, tlsconfig
from llmgw import subjects as s


def _matches(pattern: str, subject: str) -> bool:
    pat, sub = pattern.split("."), subject.split(".")
    for i, tok in enumerate(pat):
        if tok == ">":
            return len(sub) > i
        if i >= len(sub) or (tok != "*" and tok.lower() != sub[i].lower()):
            return False
    return len(pat) == len(sub)


def _can(ident: certs.Identity, action: str, subject: str) -> bool:
    return any(_matches(p, subject) for p in natsconfig.permissions(ident)[action]["allow"])


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_init_makes_a_ca_server_and_one_certificate_per_identity(tmp_path, capsys):
    assert (
        cli.main(["certs", "init", "--dir", str(tmp_path), "--nodes", "n1,n2", "--routers", "2"])
        == 0
    )
    ca = _cert(tmp_path / "ca.crt")
    names = {i.name for i in certs.read_identities(tmp_path)}
    assert names == {"agent-n1", "agent-n2", "router-1", "router-2", "reconciler", "operator"}
    for name in [*names, "server"]:
        leaf = _cert(tmp_path / f"{name}.crt")
        leaf.verify_directly_issued_by(ca)
        assert stat.S_IMODE((tmp_path / f"{name}.key").stat().st_mode) == 0o600
    assert certs.identity_from_name("agent-n1").subject == "CN=agent-n1,O=llmgw"
    assert _cert(tmp_path / "agent-n1.crt").subject.rfc4514_string() == "CN=agent-n1,O=llmgw"
    sans = _cert(tmp_path / "server.crt").extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert "localhost" in sans.value.get_values_for_type(x509.DNSName)
    assert "127.0.0.1" in {str(ip) for ip in sans.value.get_values_for_type(x509.IPAddress)}
    assert "created" in capsys.readouterr().out


def test_init_again_keeps_what_exists_and_adds_new_nodes(tmp_path):
    certs.init(tmp_path, ["n1"])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    written = certs.init(tmp_path, ["n1", "n2"])
    assert written == ["agent-n2"]
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data, f"{name} was rewritten"
    _cert(tmp_path / "agent-n2.crt").verify_directly_issued_by(_cert(tmp_path / "ca.crt"))
    # --force renews leaves but never the CA, which would invalidate every deployed one.
    renewed = certs.init(tmp_path, ["n1"], force=True)
    assert "ca" not in renewed and "agent-n1" in renewed
    assert (tmp_path / "ca.crt").read_bytes() == before["ca.crt"]


def test_init_rejects_a_node_id_that_cannot_be_a_subject_token(tmp_path, capsys):
    assert cli.main(["certs", "init", "--dir", str(tmp_path), "--nodes", "gpu.node.1"]) == 1
    assert "gpu.node.1" in capsys.readouterr().err
    assert not (tmp_path / "ca.crt").exists(), "nothing is written for a bad request"


def test_agent_permissions_stop_at_its_own_node():
    a = certs.agent_identity("node-a")
    for subject in (s.heartbeat("node-a"), s.agent_event("node-a", "shard"), s.load("node-a")):
        assert _can(a, "publish", subject)
    denied_pub = [
        s.heartbeat("node-b"),
        s.agent_event("node-b", "registered"),
        s.load("node-b"),
        s.catalog_event("model", "m"),
        s.control_event("node", "node-b"),
        s.commands("node-b"),
        "$JS.API.CONSUMER.MSG.NEXT.LLMGW_COMMANDS.agent-node-b",
        "$JS.API.CONSUMER.CREATE.LLMGW_COMMANDS.agent-node-a.llmgw.cmd.node-b",
        "$JS.API.CONSUMER.DURABLE.CREATE.LLMGW_COMMANDS.agent-node-a",
        "$JS.API.CONSUMER.CREATE.LLMGW_COMMANDS",
        "$JS.API.STREAM.CREATE.LLMGW_EVENTS",
        "$JS.API.STREAM.UPDATE.LLMGW_EVENTS",
        "$JS.API.STREAM.MSG.GET.LLMGW_COMMANDS",
        "$JS.API.DIRECT.GET.LLMGW_COMMANDS.llmgw.cmd.node-b",
        "$JS.ACK.LLMGW_COMMANDS.agent-node-b.1.1.1.1.1",
        f"$KV.{s.ENDPOINTS_BUCKET}.m",
    ]
    for subject in denied_pub:
        assert not _can(a, "publish", subject), subject
    for subject in (s.commands("node-b"), s.commands("node-a"), "_INBOX.router-1.x", "_INBOX.x"):
        assert not _can(a, "subscribe", subject), subject
    assert _can(a, "subscribe", "_INBOX.agent-node-a.abc.1")


def test_router_reads_projections_and_writes_only_presence():
    r = certs.identity_from_name("router-1")
    for bucket in (s.ENDPOINTS_BUCKET, s.TENANTS_BUCKET):
        assert _can(r, "publish", f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.m")
        assert _can(r, "publish", f"$JS.API.CONSUMER.CREATE.KV_{bucket}")
        assert _can(r, "publish", f"$JS.API.CONSUMER.CREATE.KV_{bucket}.watch1.$KV.{bucket}.>")
        assert not _can(r, "publish", f"$KV.{bucket}.m")
    assert _can(r, "publish", f"$KV.{s.ROUTERS_BUCKET}.router-1")
    assert _can(r, "subscribe", s.load("node-a"))
    for subject in (
        s.agent_event("node-a", "registered"),
        s.catalog_event("model", "m"),
        s.commands("node-a"),
        "$JS.API.STREAM.DELETE.KV_llmgw-endpoints",
        "$JS.API.CONSUMER.CREATE.LLMGW_EVENTS",
    ):
        assert not _can(r, "publish", subject), subject
    assert not _can(r, "subscribe", s.commands("node-a"))


def test_a_router_identity_speaks_only_for_its_own_router_id():
    r1 = certs.identity_from_name("router-1")
    assert r1.router_id == "router-1"
    assert _can(r1, "publish", s.demand("router-1"))
    assert _can(r1, "publish", s.router_presence("router-1"))
    for subject in (
        s.demand("router-2"),
        s.router_presence("router-2"),
        f"$KV.{s.ROUTERS_BUCKET}.router-10",
        f"$KV.{s.ROUTERS_BUCKET}.router-1.x",
        # Removing another's entry through the API rather than a marker: not allowed either.
        f"$JS.API.STREAM.MSG.DELETE.KV_{s.ROUTERS_BUCKET}",
        f"$JS.API.STREAM.PURGE.KV_{s.ROUTERS_BUCKET}",
    ):
        assert not _can(r1, "publish", subject), subject
    # Reading every router's presence (to count them) stays allowed.
    assert _can(r1, "subscribe", s.router_presence("router-2"))
    assert _can(r1, "publish", f"$JS.API.CONSUMER.CREATE.KV_{s.ROUTERS_BUCKET}")
    # Each router identity gets its own rules in the rendered config.
    text = natsconfig.render_authorization(certs.identities([], 2))
    for rid in ("router-1", "router-2"):
        assert text.count(f'"{s.demand(rid)}"') == 1
        assert text.count(f'"{s.router_presence(rid)}"') == 1
    assert f'"{s.DEMAND_ALL}"' not in text
    # So do the Helm values (the same users, for the chart's config.merge).
    helm = yaml.safe_load(natsconfig.render_helm_values(certs.identities([], 2)))
    users = {u["user"]: u["permissions"] for u in helm["config"]["merge"]["authorization"]["users"]}
    r2 = users["CN=router-2,O=llmgw"]["publish"]["allow"]
    assert s.demand("router-2") in r2 and s.router_presence("router-2") in r2
    assert s.demand("router-1") not in r2 and s.router_presence("router-1") not in r2


def test_nats_config_adds_routers_whose_certificates_are_issued_elsewhere(tmp_path, capsys):
    # cert-manager's csi-driver issues each router pod its own certificate, named from the
    # pod (CN router-${POD_NAME}): no file for it lies in --certs, yet it needs its user.
    certs.init(tmp_path, ["n1"], routers=0)
    out = tmp_path / "values.yaml"
    argv = ["nats-config", "--certs", str(tmp_path), "--format", "helm-values", "--out", str(out)]
    pods = ["--router", "router-llmgw-router-0", "--router", "router-llmgw-router-1"]
    assert cli.main([*argv, *pods]) == 0
    helm = yaml.safe_load(out.read_text())
    users = {u["user"]: u["permissions"] for u in helm["config"]["merge"]["authorization"]["users"]}
    r0 = users["CN=router-llmgw-router-0,O=llmgw"]["publish"]["allow"]
    assert s.demand("router-llmgw-router-0") in r0
    assert s.demand("router-llmgw-router-1") not in r0
    assert "CN=router-llmgw-router-1,O=llmgw" in users
    capsys.readouterr()
    assert cli.main([*argv, "--router", "operator"]) == 1
    assert "--router operator: not a router identity" in capsys.readouterr().err


def test_operator_publishes_catalog_events_only():
    op = certs.identity_from_name("operator")
    assert _can(op, "publish", s.catalog_event("tenant", "t"))
    assert _can(op, "publish", "$JS.API.CONSUMER.CREATE.LLMGW_EVENTS")
    for subject in (
        s.agent_event("n", "registered"),
        s.control_event("placement", "r1"),
        s.commands("n"),
        "$JS.API.STREAM.DELETE.LLMGW_EVENTS",
        "$JS.API.STREAM.PURGE.LLMGW_EVENTS",
    ):
        assert not _can(op, "publish", subject), subject


def test_nats_config_needs_certificates_from_certs_init(tmp_path, capsys):
    out = tmp_path / "nats.conf"
    assert cli.main(["nats-config", "--certs", str(tmp_path), "--out", str(out)]) == 1
    assert "llmgw certs init" in capsys.readouterr().err
    certs.init(tmp_path / "c", ["n1"])
    (tmp_path / "c" / "stray.crt").write_bytes((tmp_path / "c" / "operator.crt").read_bytes())
    assert cli.main(["nats-config", "--certs", str(tmp_path / "c"), "--out", str(out)]) == 1
    assert "stray.crt" in capsys.readouterr().err


def test_tls_section_is_off_by_default_and_names_the_key_at_fault(tmp_path):
    assert tlsconfig.nats_options(tlsconfig.NatsTLS()) == {}
    certs.init(tmp_path, ["n1"])
    ok = tlsconfig.NatsTLS(
        ca=str(tmp_path / "ca.crt"),
        cert=str(tmp_path / "agent-n1.crt"),
        key=str(tmp_path / "agent-n1.key"),
    )
    opts = tlsconfig.nats_options(ok)
    assert opts["inbox_prefix"] == "_INBOX.agent-n1"
    assert opts["tls"].verify_mode.name == "CERT_REQUIRED"
    wrong_key = tlsconfig.NatsTLS(ca=ok.ca, cert=ok.cert, key=str(tmp_path / "operator.key"))
    with pytest.raises(config.ConfigError, match="nats_tls.cert / nats_tls.key"):
        tlsconfig.nats_options(wrong_key)
    with pytest.raises(config.ConfigError, match="nats_tls.ca"):
        tlsconfig.nats_options(tlsconfig.NatsTLS(ca=str(tmp_path / "nope.crt")))
    with pytest.raises(config.ConfigError, match="together"):
        tlsconfig.nats_options(tlsconfig.NatsTLS(ca=ok.ca, cert=ok.cert))

    # The section loads from the environment like any config key.
    class Svc(config.ConfigStruct, kw_only=True):
        nats_tls: tlsconfig.NatsTLS = msgspec.field(default_factory=tlsconfig.NatsTLS)

    env = {
        "LLMGW_NATS_TLS__CA": ok.ca,
        "LLMGW_NATS_TLS__CERT": ok.cert,
        "LLMGW_NATS_TLS__KEY": ok.key,
    }
    assert config.load(Svc, env=env).nats_tls == ok
