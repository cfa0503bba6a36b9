"""Where the reconciler and the operator CLI take their NATS identity from."""

import json

import pytest

from llmgw import certs
from llmgw.opcli import apiclient
from llmgw.reconciler.config import ReconcilerConfig, validate
from llmgw.tlsconfig import NatsTLS


def test_a_reconciler_with_unusable_tls_files_does_not_start(tmp_path):
    problems = validate(ReconcilerConfig(nats_tls=NatsTLS(ca=str(tmp_path / "nope.crt"))))
    assert any("nats_tls.ca" in p and "no such file" in p for p in problems)
    certs.init(tmp_path, [], routers=0)
    mismatched = NatsTLS(
        ca=str(tmp_path / "ca.crt"),
        cert=str(tmp_path / "operator.crt"),
        key=str(tmp_path / "reconciler.key"),
    )
    assert any("not a matching certificate and key" in p for p in validate(
        ReconcilerConfig(nats_tls=mismatched)
    ))  # fmt: skip
    assert validate(ReconcilerConfig()) == []


def test_cli_identity_from_env_then_from_the_dev_cluster_it_talks_to(tmp_path, monkeypatch):
    for key in ("CA", "CERT", "KEY", "SERVER_NAME"):
        monkeypatch.delenv(f"LLMGW_NATS_TLS__{key}", raising=False)
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path))
    saved = {"ca": "/d/ca.crt", "cert": "/d/operator.crt", "key": "/d/operator.key"}
    (tmp_path / "cluster.json").write_text(
        json.dumps({"nats_url": "tls://127.0.0.1:4222", "nats_tls": saved})
    )
    assert apiclient.find_nats_tls("tls://127.0.0.1:4222") == NatsTLS(**saved)
    # Another server than the dev cluster's: its certificate is not offered there.
    assert apiclient.find_nats_tls("nats://elsewhere:4222") == NatsTLS()
    monkeypatch.setenv("LLMGW_NATS_TLS__CA", "/env/ca.crt")
    assert apiclient.find_nats_tls("tls://127.0.0.1:4222") == NatsTLS(ca="/env/ca.crt")
    monkeypatch.setenv("LLMGW_NATS_TLS__CA", str(tmp_path / "missing.crt"))
    with pytest.raises(apiclient.ApiError, match="nats_tls.ca"):
        apiclient.nats_options("tls://127.0.0.1:4222")
