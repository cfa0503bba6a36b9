"""The reconciler's `admin_tls` section, the certificate it serves, and where the CLI finds its own."""

import json
import ssl

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw import certs, config, tlsconfig
from llmgw.opcli import apiclient
from llmgw.reconciler.config import ReconcilerConfig, validate


@pytest.fixture
def certs_dir(tmp_path):
    certs.init(tmp_path, [], routers=0)
    return tmp_path


def section(d, cert="reconciler-admin", key="reconciler-admin", ca="ca") -> tlsconfig.AdminTLS:
    return tlsconfig.AdminTLS(
        cert=str(d / f"{cert}.crt") if cert else "",
        key=str(d / f"{key}.key") if key else "",
        ca=str(d / f"{ca}.crt") if ca else "",
    )


def test_admin_tls_is_off_by_default_and_asks_every_client_for_a_certificate(certs_dir):
    assert tlsconfig.admin_server_options(tlsconfig.AdminTLS()) == {}
    assert validate(ReconcilerConfig()) == []
    opts = tlsconfig.admin_server_options(section(certs_dir))
    assert opts["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert opts["ssl_ca_certs"] == str(certs_dir / "ca.crt")
    assert validate(ReconcilerConfig(admin_tls=section(certs_dir))) == []

    ok = section(certs_dir)
    env = {"LLMGW_ADMIN_TLS__CERT": ok.cert, "LLMGW_ADMIN_TLS__KEY": ok.key}
    env["LLMGW_ADMIN_TLS__CA"] = ok.ca
    assert config.load(ReconcilerConfig, env=env).admin_tls == ok


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"key": None}, "admin_tls: cert and key must be given together"),
        ({"cert": None}, "admin_tls: cert and key must be given together"),
        ({"ca": None}, "admin_tls.ca: required with admin_tls.cert"),
        ({"cert": None, "key": None}, "admin_tls.cert, admin_tls.key: required with admin_tls.ca"),
        ({"ca": "nope"}, "admin_tls.ca = '{d}/nope.crt': no such file"),
        ({"cert": "nope"}, "admin_tls.cert = '{d}/nope.crt': no such file"),
        ({"key": "nope"}, "admin_tls.key = '{d}/nope.key': no such file"),
        ({"key": "operator"}, "admin_tls.cert / admin_tls.key: not a matching certificate and key"),
    ],
)
def test_a_bad_admin_tls_section_stops_the_reconciler_naming_the_field(certs_dir, kw, expected):
    problems = validate(ReconcilerConfig(admin_tls=section(certs_dir, **kw)))
    assert problems == [problems[0]] and problems[0].startswith(expected.format(d=certs_dir))


def test_a_ca_file_that_holds_no_certificate_is_named(certs_dir):
    (certs_dir / "empty.crt").write_text("not a certificate\n")
    problems = validate(ReconcilerConfig(admin_tls=section(certs_dir, ca="empty")))
    assert len(problems) == 1 and problems[0].startswith("admin_tls.ca = "), problems


def test_certs_init_issues_the_admin_listener_its_own_server_certificate(tmp_path):
    assert "reconciler-admin" in certs.init(tmp_path, ["n1"], admin_hosts=["cp.example"])
    leaf = x509.load_pem_x509_certificate((tmp_path / "reconciler-admin.crt").read_bytes())
    leaf.verify_directly_issued_by(
        x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    )
    usage = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "llmgw-reconciler", "cp.example"} <= set(
        sans.get_values_for_type(x509.DNSName)
    )
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    # Not the NATS server's key, and no client identity of the bus.
    assert (tmp_path / "reconciler-admin.key").read_bytes() != (
        tmp_path / "server.key"
    ).read_bytes()
    assert "reconciler-admin" not in {i.name for i in certs.read_identities(tmp_path)}
    # Additive: a folder from before it existed gains it, and nothing else changes.
    (tmp_path / "reconciler-admin.crt").unlink()
    assert certs.init(tmp_path, ["n1"]) == ["reconciler-admin"]
    assert certs.init(tmp_path, ["n1"]) == []


def test_cli_api_tls_from_flags_then_env_then_the_dev_cluster_it_talks_to(tmp_path, monkeypatch):
    for key in ("CA", "CERT", "KEY"):
        monkeypatch.delenv(f"LLMGW_API_TLS__{key}", raising=False)
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path))
    saved = {"ca": "/d/ca.crt", "cert": "/d/operator.crt", "key": "/d/operator.key"}
    ours = "https://127.0.0.1:9300"
    (tmp_path / "cluster.json").write_text(
        json.dumps(
            {"api_url": ours, "api_urls": [ours, "https://127.0.0.1:9301"], "api_tls": saved}
        )
    )
    assert apiclient.find_api_tls(None, ours) == apiclient.ApiTLS(**saved)
    assert apiclient.find_api_tls(None, "https://127.0.0.1:9301/") == apiclient.ApiTLS(**saved)
    # Another API than the dev cluster's: its certificate is not offered there.
    assert not apiclient.find_api_tls(None, "https://elsewhere:9300")
    monkeypatch.setenv("LLMGW_API_TLS__CERT", "/env/op.crt")
    assert apiclient.find_api_tls(None, ours) == apiclient.ApiTLS(cert="/env/op.crt")
    flags = apiclient.ApiTLS(ca="/f/ca.crt")
    assert apiclient.find_api_tls(flags, ours) == flags

    # Unusable files are one ApiError naming the setting, before any connection.
    with pytest.raises(apiclient.ApiError, match="api_tls.ca = '/f/ca.crt': no such file"):
        apiclient.get_json(ours, "/api/models", tls=flags)
