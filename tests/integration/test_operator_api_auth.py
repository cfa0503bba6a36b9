"""Who may call the operator API, on a real `llmgw reconciler` (real NATS and Postgres).

Tokens reach the process the way a deployment gives them (LLMGW_API_TOKENS from
a Secret or .env); the CLI sends its token from --token or LLMGW_API_TOKEN.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw import keys, procs
from llmgw.dev import servers as localservers
from llmgw.reconciler.api import admin, auth

ADMIN_TOKEN = keys.new_key()
READ_TOKEN = keys.new_key()
TOKENS = [
    {"name": "ops", "role": "admin", "hash": keys.hash_key(ADMIN_TOKEN)},
    {"name": "dashboard", "role": "read", "hash": keys.hash_key(READ_TOKEN)},
]


@pytest.fixture
def api(engine, nats_url, database_url) -> Iterator[str]:
    """A reconciler process with an admin and a read token; yields its API's URL."""
    port = localservers.free_port()
    group = procs.Group()
    argv = procs.llmgw_argv(
        "reconciler", "--nats", nats_url, "--database-url", database_url,
        "--admin-listen", f"127.0.0.1:{port}", "--id", "auth",
    )  # fmt: skip
    child = group.start("reconciler", argv, env={"LLMGW_API_TOKENS": json.dumps(TOKENS)})
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert procs.wait_until(up, 60), f"the reconciler did not start:\n{child.output()}"
        yield url
    finally:
        group.stop()


def get(url: str, token: str | None = None, scheme: str = "Bearer") -> httpx.Response:
    headers = {"Authorization": f"{scheme} {token}"} if token else {}
    return httpx.get(url, headers=headers, timeout=10)


def test_tokens_and_roles_decide_who_reads_what_and_probes_stay_open(api):
    for probe in ("/healthz", "/readyz", "/metrics"):
        assert get(api + probe).status_code == 200, probe

    missing = get(api + "/api/models")
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    error = missing.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "missing_token"
    assert set(error) == {"message", "type", "param", "code"}  # the shape of the API's 404

    wrong = get(api + "/api/models", keys.new_key())
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_token"
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert get(api + "/api/models", ADMIN_TOKEN, scheme="Basic").status_code == 401
    # The hash is what the config holds; it is not a credential.
    assert get(api + "/api/models", keys.hash_key(ADMIN_TOKEN)).status_code == 401

    for path in ("/api/status", "/api/nodes", "/api/models", "/api/replicas", "/api/endpoints",
                 "/api/bands", "/api/events", "/api/dead-letters"):  # fmt: skip
        assert get(api + path, READ_TOKEN).status_code == 200, path
        assert get(api + path, ADMIN_TOKEN).status_code == 200, path
    assert get(api + "/api/explain/nope", READ_TOKEN).status_code == 404  # let in, not found

    for path in ("/api/catalog", "/api/tenants"):
        refused = get(api + path, READ_TOKEN)
        assert refused.status_code == 403, path
        error = refused.json()["error"]
        assert error["type"] == "permission_error" and error["code"] == "insufficient_role"
        assert "'dashboard'" in error["message"] and "'admin'" in error["message"]
        assert get(api + path, ADMIN_TOKEN).status_code == 200, path
    assert get(api + "/api/catalog", ADMIN_TOKEN).json()["tenants"] == []


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        procs.llmgw_argv(*args), capture_output=True, text=True, timeout=60, env=env
    )


def test_the_cli_sends_its_token_from_the_flag_or_the_environment(api, tmp_path, monkeypatch):
    monkeypatch.delenv("LLMGW_API_TOKEN", raising=False)
    monkeypatch.delenv("LLMGW_API_URL", raising=False)
    env = {**os.environ, "LLMGW_DATA_DIR": str(tmp_path / "no-cluster")}

    without = cli("get", "models", "--api", api, env=env)
    assert without.returncode == 1
    (line,) = without.stderr.splitlines()
    assert "HTTP 401" in line and "--token" in line and "LLMGW_API_TOKEN" in line

    from_env = cli("get", "models", "--api", api, env={**env, "LLMGW_API_TOKEN": READ_TOKEN})
    assert from_env.returncode == 0, from_env.stderr
    assert from_env.stdout.split()[0] == "NAME"

    from_flag = cli("get", "models", "--api", api, "--token", READ_TOKEN, env=env)
    assert from_flag.returncode == 0, from_flag.stderr
    # The flag wins over the environment.
    both = cli("get", "models", "--api", api, "--token", "wrong", env={
        **env, "LLMGW_API_TOKEN": READ_TOKEN})  # fmt: skip
    assert both.returncode == 1 and "HTTP 401" in both.stderr

    too_low = cli("get", "tenants", "--api", api, "--token", READ_TOKEN, env=env)
    assert too_low.returncode == 1
    (line,) = too_low.stderr.splitlines()
    assert "HTTP 403" in line and "'admin'" in line
    assert cli("get", "tenants", "--api", api, "--token", ADMIN_TOKEN, env=env).returncode == 0

    export = cli("events", "export", "--api", api, "--token", READ_TOKEN, env=env)
    assert export.returncode == 0, export.stderr
    explain = cli("explain", "nope", "--api", api, "--token", READ_TOKEN, env=env)
    assert explain.returncode == 1 and "HTTP 404" in explain.stderr

    # A dev cluster's token is sent to that cluster's API, found in its cluster.json.
    data_dir = Path(env["LLMGW_DATA_DIR"])
    data_dir.mkdir()
    (data_dir / "cluster.json").write_text(json.dumps({"api_url": api, "api_token": READ_TOKEN}))
    assert cli("get", "models", "--api", api, env=env).returncode == 0


async def test_with_no_token_configured_the_api_refuses_and_says_how_to_configure(engine):
    app = admin.build_app(engine, admin.Role("r1", "standby"), auth.Authorizer("tokens", []))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
        refused = await client.get("/api/nodes", headers={"Authorization": "Bearer anything"})
        assert (await client.get("/readyz")).status_code == 200
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    error = refused.json()["error"]
    assert error["code"] == "no_tokens_configured"
    assert "api_tokens" in error["message"] and "llmgw keys new" in error["message"]


async def test_apply_and_audit_replay_send_their_token_where_they_read_the_api(
    nats, api, nats_url, tmp_path, monkeypatch
):  # nats first: it deletes every stream, and the reconciler then provisions its own
    from llmgw import subjects

    monkeypatch.delenv("LLMGW_API_TOKEN", raising=False)
    monkeypatch.delenv("LLMGW_API_URL", raising=False)
    env = {**os.environ, "LLMGW_DATA_DIR": str(tmp_path / "no-cluster")}
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text("bands: [{name: gold}]\n")

    def apply(*args: str) -> subprocess.CompletedProcess:
        return cli("apply", "-f", str(catalog), "--nats", nats_url, "--api", api, *args, env=env)

    assert apply().returncode == 0
    folded = lambda: get(api + "/api/catalog", ADMIN_TOKEN).json()["bands"]  # noqa: E731
    assert procs.wait_until(lambda: bool(folded()), 30)
    # As retention would: the stream no longer starts at seq 1, so apply reads the API.
    await nats.jetstream().purge_stream(subjects.EVENTS_STREAM)

    without = apply()
    assert without.returncode == 1
    assert "HTTP 401" in without.stderr and "--token" in without.stderr
    too_low = apply("--token", READ_TOKEN)
    assert too_low.returncode == 1
    assert "HTTP 403" in too_low.stderr and "llmgw apply needs an admin token" in too_low.stderr
    allowed = apply("--token", ADMIN_TOKEN)
    assert allowed.returncode == 0, allowed.stderr
    assert "no changes" in allowed.stdout

    replay = cli("audit", "replay", "--api", api, "--token", READ_TOKEN, env=env)
    assert replay.returncode in (0, 1), replay.stderr  # read, whatever the verdict
    assert f"log read from the operator API at {api}" in replay.stdout
    refused = cli("audit", "replay", "--api", api, env=env)
    assert refused.returncode == 3 and "HTTP 401" in refused.stderr
