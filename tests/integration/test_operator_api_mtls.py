"""The operator API over mutual TLS, on a real `llmgw reconciler` (real NATS and Postgres).

The process is given `admin_tls` the way a deployment gives it (LLMGW_ADMIN_TLS__*)
with the `reconciler-admin` certificate of `llmgw certs init`: a client presenting no
certificate, one from another CA, or speaking plain HTTP never reaches the app; the
operator's certificate does, and its token still decides the role.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw import certs, keys, procs, tlsconfig
from llmgw.dev import servers as localservers

READ_TOKEN = keys.new_key()
TOKENS = [{"name": "dashboard", "role": "read", "hash": keys.hash_key(READ_TOKEN)}]


@pytest.fixture
def certs_dir(tmp_path) -> Path:
    certs.init(tmp_path / "certs", [], routers=0)
    return tmp_path / "certs"


def operator(certs_dir: Path, identity: str = "operator") -> ssl.SSLContext:
    d = certs_dir
    return tlsconfig.client_context(
        str(d / "ca.crt"), str(d / f"{identity}.crt"), str(d / f"{identity}.key"), "test"
    )


@pytest.fixture
def api(engine, nats_url, database_url, certs_dir) -> Iterator[str]:
    """A reconciler serving its admin listener with mTLS; yields its https URL."""
    port = localservers.free_port()
    group = procs.Group()
    argv = procs.llmgw_argv(
        "reconciler", "--nats", nats_url, "--database-url", database_url,
        "--admin-listen", f"127.0.0.1:{port}", "--id", "mtls",
    )  # fmt: skip
    env = {
        "LLMGW_API_TOKENS": json.dumps(TOKENS),
        "LLMGW_ADMIN_TLS__CERT": str(certs_dir / "reconciler-admin.crt"),
        "LLMGW_ADMIN_TLS__KEY": str(certs_dir / "reconciler-admin.key"),
        "LLMGW_ADMIN_TLS__CA": str(certs_dir / "ca.crt"),
    }
    child = group.start("reconciler", argv, env=env)
    url = f"https://127.0.0.1:{port}"
    verify = operator(certs_dir)

    def up() -> bool:
        try:
            return httpx.get(f"{url}/healthz", verify=verify, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert procs.wait_until(up, 60), f"the reconciler did not start:\n{child.output()}"
        yield url
    finally:
        group.stop()


def get(url: str, verify: ssl.SSLContext | bool, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(url, headers=headers, verify=verify, timeout=10)


def test_only_a_client_with_a_certificate_of_the_ca_reaches_the_api(api, certs_dir, tmp_path):
    ca = str(certs_dir / "ca.crt")
    with_cert = operator(certs_dir)
    assert get(api + "/api/models", with_cert, READ_TOKEN).status_code == 200
    # The certificate admits the machine; the token still decides the role.
    assert get(api + "/api/models", with_cert).status_code == 401
    assert get(api + "/api/tenants", with_cert, READ_TOKEN).status_code == 403
    for probe in ("/healthz", "/readyz", "/metrics"):
        assert get(api + probe, with_cert).status_code == 200, probe

    # No client certificate: the handshake is refused, the token never gets a hearing.
    no_cert = ssl.create_default_context(cafile=ca)
    for path in ("/api/models", "/healthz"):
        with pytest.raises(httpx.TransportError):
            get(api + path, no_cert, READ_TOKEN)

    # A certificate with the operator's name, from another CA.
    certs.init(tmp_path / "rogue", [], routers=0)
    rogue = tlsconfig.client_context(
        ca, str(tmp_path / "rogue/operator.crt"), str(tmp_path / "rogue/operator.key"), "test"
    )
    with pytest.raises(httpx.TransportError):
        get(api + "/api/models", rogue, READ_TOKEN)

    # Plain HTTP to the same port gets no answer at all.
    with pytest.raises(httpx.TransportError):
        get(api.replace("https://", "http://") + "/api/models", False, READ_TOKEN)


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        procs.llmgw_argv(*args), capture_output=True, text=True, timeout=60, env=env
    )


def test_the_cli_presents_the_operator_certificate_from_flags_or_environment(
    api, certs_dir, tmp_path
):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_API", "LLMGW_NATS"))}
    env["LLMGW_DATA_DIR"] = str(tmp_path / "no-cluster")
    env["LLMGW_API_TOKEN"] = READ_TOKEN
    files = {
        "ca": str(certs_dir / "ca.crt"),
        "cert": str(certs_dir / "operator.crt"),
        "key": str(certs_dir / "operator.key"),
    }

    without = cli("get", "models", "--api", api, env=env)
    assert without.returncode == 1
    (line,) = without.stderr.splitlines()
    assert "TLS" in line and "--api-cert" in line and "LLMGW_API_TLS__" in line

    # The server's CA but no certificate of its own: the listener hangs up on it.
    ca_only = cli("get", "models", "--api", api, f"--api-ca={files['ca']}", env=env)
    assert ca_only.returncode == 1
    (line,) = ca_only.stderr.splitlines()
    assert "TLS" in line and "--api-cert" in line
    plain = cli("get", "models", "--api", api.replace("https:", "http:"), env=env)
    assert plain.returncode == 1 and "only https" in plain.stderr, plain.stderr

    flags = [f"--api-{k}={v}" for k, v in files.items()]
    from_flags = cli("get", "models", "--api", api, *flags, env=env)
    assert from_flags.returncode == 0, from_flags.stderr
    assert from_flags.stdout.split()[0] == "NAME"

    tls_env = {f"LLMGW_API_TLS__{k.upper()}": v for k, v in files.items()}
    export = cli("events", "export", "--api", api, env={**env, **tls_env})
    assert export.returncode == 0, export.stderr

    # A CA that did not sign the API's certificate: the client refuses the server.
    certs.init(tmp_path / "other", [], routers=0)
    wrong_ca = {**tls_env, "LLMGW_API_TLS__CA": str(tmp_path / "other/ca.crt")}
    refused = cli("explain", "m", "--api", api, env={**env, **wrong_ca})
    assert refused.returncode == 1
    (line,) = refused.stderr.splitlines()
    assert "TLS" in line and "CERTIFICATE_VERIFY_FAILED" in line
