"""The operator API's tokens: how they are configured, checked, and found by the CLI."""

from __future__ import annotations

import json

import pytest

from llmgw import config, keys
from llmgw.opcli import apiclient
from llmgw.reconciler.api import auth
from llmgw.reconciler.config import ReconcilerConfig, validate

TOKEN = keys.new_key()


def token(**kw) -> auth.ApiToken:
    return auth.ApiToken(**{"name": "ops", "role": "admin", "hash": keys.hash_key(TOKEN), **kw})


def test_tokens_come_from_the_environment_as_a_list():
    env = {"LLMGW_API_TOKENS": json.dumps([{"name": "ops", "role": "read", "hash": "sha256:x"}])}
    cfg = config.load(ReconcilerConfig, env=env)
    assert cfg.api_tokens == [auth.ApiToken(name="ops", role="read", hash="sha256:x")]
    with pytest.raises(config.ConfigError, match=r"api_tokens\[0\]"):
        config.load(ReconcilerConfig, env={"LLMGW_API_TOKENS": "[{name: ops, role: read}]"})


def test_each_problem_names_its_field():
    problems = validate(
        ReconcilerConfig(
            api_tokens=[
                token(),
                token(role="root", hash=TOKEN),  # the token itself, not its hash
                token(name=" ", hash=keys.hash_key("another")),
            ]
        )
    )
    assert problems == [
        "api_tokens[1].name = 'ops': another token has this name",
        "api_tokens[1].role = 'root': must be one of read, admin",
        "api_tokens[1].hash: must be 'sha256:' and 64 lowercase hex digits "
        "(`llmgw keys new` or `llmgw keys hash` prints one), not the token itself",
        "api_tokens[2].name: must not be empty",
    ]
    assert validate(ReconcilerConfig(api_auth="open"))[0].startswith("api_auth = 'open'")


def test_one_token_listed_twice_is_refused_whatever_its_roles():
    # Looked up by hash, the last entry would win: a read token listed again as admin is admin.
    problems = validate(
        ReconcilerConfig(api_tokens=[token(name="grafana", role="read"), token(name="ops")])
    )
    assert problems == ["api_tokens[1].hash: same as api_tokens[0]"]
    assert validate(ReconcilerConfig(api_tokens=[token(), token(name="again")])) == [
        "api_tokens[1].hash: same as api_tokens[0]"
    ]


def test_no_authentication_only_on_loopback_and_never_beside_tokens():
    assert ReconcilerConfig().admin_listen.startswith("127.0.0.1:")
    for listen in ("127.0.0.1:9300", ":9300", "localhost:9300", "[::1]:9300"):
        assert validate(ReconcilerConfig(api_auth="none", admin_listen=listen)) == [], listen
    (problem,) = validate(ReconcilerConfig(api_auth="none", admin_listen="0.0.0.0:9300"))
    assert problem.startswith("api_auth = none: only for an admin_listen on loopback")
    (problem,) = validate(ReconcilerConfig(api_auth="none", api_tokens=[token()]))
    assert "api_tokens would be ignored" in problem


def test_the_role_decides_and_unknown_or_malformed_tokens_are_refused():
    read = token(name="dash", role="read", hash=keys.hash_key("r"))
    checker = auth.Authorizer("tokens", [token(), read])
    assert checker.check(f"Bearer {TOKEN}", auth.ADMIN) is None
    assert checker.check(f"bearer  {TOKEN} ", auth.READ) is None
    assert checker.check("Bearer r", auth.READ) is None
    assert checker.check("Bearer r", auth.ADMIN) == auth.Denied(
        403, "insufficient_role", "token 'dash' has role 'read'; this needs 'admin'"
    )
    for header in (None, "", "Bearer", f"Basic {TOKEN}", "Bearer nope", keys.hash_key(TOKEN)):
        denied = checker.check(header, auth.READ)
        assert denied is not None and denied.status == 401, header
    assert auth.Authorizer("tokens", []).check(f"Bearer {TOKEN}", auth.READ).code == (
        "no_tokens_configured"
    )
    assert auth.Authorizer("none", []).check(None, auth.ADMIN) is None


def test_the_cli_finds_its_token_and_sends_a_dev_clusters_only_to_that_cluster(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("LLMGW_API_TOKEN", raising=False)
    assert apiclient.find_api_token(None, "http://dev:9300") is None
    (tmp_path / "cluster.json").write_text(
        json.dumps(
            {
                "api_url": "http://dev:9300",
                "api_urls": ["http://dev:9300", "http://dev:9301"],
                "api_token": "dev-token",
            }
        )
    )
    assert apiclient.find_api_token(None, "http://dev:9300/") == "dev-token"
    assert apiclient.find_api_token(None, "http://dev:9301") == "dev-token"
    assert apiclient.find_api_token(None, "http://prod:9300") is None
    monkeypatch.setenv("LLMGW_API_TOKEN", "env-token")
    assert apiclient.find_api_token(None, "http://prod:9300") == "env-token"
    assert apiclient.find_api_token("flag-token", "http://prod:9300") == "flag-token"


def test_a_dev_data_dir_keeps_its_api_token_across_runs(tmp_path):
    from llmgw.dev import cluster as devcluster

    first = devcluster._api_token(tmp_path)
    assert first.startswith(keys.KEY_PREFIX)
    assert devcluster._api_token(tmp_path) == first
    assert (tmp_path / "api-token.json").stat().st_mode & 0o777 == 0o600


def test_the_reconciler_refuses_to_start_with_a_bad_token_config():
    import os
    import subprocess

    from llmgw import procs

    tokens = json.dumps([{"name": "x", "role": "root", "hash": keys.hash_key(TOKEN)}])
    res = subprocess.run(
        procs.llmgw_argv("reconciler", "--admin-listen", "0.0.0.0:9300", "--api-auth", "none"),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LLMGW_API_TOKENS": tokens},
    )
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "llmgw reconciler: api_auth = none: only for an admin_listen on loopback, not "
        "'0.0.0.0' (anyone who reaches the port would read the catalog); configure api_tokens",
        "llmgw reconciler: api_tokens[0].role = 'root': must be one of read, admin",
    ]
