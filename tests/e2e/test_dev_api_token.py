"""`llmgw dev` guards its operator API with a token of its own, which its CLI finds.

One small cluster (one agent, one router, two reconcilers): both reconcilers
refuse the API without the cluster's admin token and serve everything with it;
the operator CLI, given nothing but the data dir, reads URL and token from
cluster.json.
"""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from llmgw import procs
from tests.e2e import clusterkit as ck

pytestmark = pytest.mark.e2e


def test_the_dev_cluster_makes_prints_and_uses_an_admin_token(tmp_path, capsys):
    data_dir = tmp_path / "dev"
    cluster = ck.start_cluster(data_dir, routers=1, agents=1, reconcilers=2)
    try:
        info = json.loads((data_dir / "cluster.json").read_text())
        token = info["api_token"]
        assert token == json.loads((data_dir / "api-token.json").read_text())["token"]
        assert f"API token       : {token}" in capsys.readouterr().out
        for base in info["api_urls"]:
            refused = httpx.get(f"{base}/api/catalog", timeout=5)
            assert refused.status_code == 401, base
            allowed = httpx.get(f"{base}/api/catalog", headers=ck.api_headers(cluster), timeout=5)
            assert allowed.status_code == 200, base

        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_API_")}
        env["LLMGW_DATA_DIR"] = str(data_dir)
        res = subprocess.run(
            procs.llmgw_argv("get", "tenants"), capture_output=True, text=True, env=env, timeout=60
        )
        assert res.returncode == 0, res.stderr
        assert {"demo", "batch"} <= {line.split()[0] for line in res.stdout.splitlines()}
        res = subprocess.run(
            procs.llmgw_argv("get", "tenants", "--token", "sk-llmgw-wrong"),
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert res.returncode == 1 and "HTTP 401" in res.stderr

        # The token and the demo keys are the user's alone (no other local user reads them).
        for name in ("cluster.json", "api-token.json", "demo-keys.json"):
            assert (data_dir / name).stat().st_mode & 0o777 == 0o600, name
        # Run as root, the dev Postgres runs as another user, which must traverse the dir
        # to its own; no one else may list or write it either way.
        assert data_dir.stat().st_mode & 0o066 == 0, oct(data_dir.stat().st_mode)
    finally:
        cluster.stop()
