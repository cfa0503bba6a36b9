"""`llmgw dev` keeps its credentials to the user who runs it.

cluster.json holds the operator API's admin token (and the paths to the
operator's key), api-token.json the same token, demo-keys.json two tenant keys
in clear: none may be readable by another local user, not even for the moment
between writing a file and narrowing its mode.
"""

from __future__ import annotations

import json
import os

import pytest

from llmgw.dev import cluster as devcluster


@pytest.fixture(autouse=True)
def usual_umask():
    old = os.umask(0o022)  # what most shells give: files 0644, dirs 0755
    yield
    os.umask(old)


def mode(path) -> int:
    return path.stat().st_mode & 0o777


def test_the_data_dir_is_the_users_alone_new_or_old(tmp_path):
    fresh = tmp_path / "a" / "dev"
    devcluster.prepare_data_dir(fresh)
    assert mode(fresh) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    devcluster.prepare_data_dir(old)
    assert mode(old) == 0o700


def test_files_with_credentials_are_created_private_and_an_old_one_is_narrowed(tmp_path):
    info = tmp_path / "cluster.json"
    devcluster.write_private(info, json.dumps({"api_token": "t"}))
    assert mode(info) == 0o600
    info.chmod(0o644)  # as an earlier llmgw dev left it
    devcluster.write_private(info, json.dumps({"api_token": "u"}))
    assert mode(info) == 0o600
    assert json.loads(info.read_text()) == {"api_token": "u"}

    devcluster._api_token(tmp_path)
    devcluster._demo_keys(tmp_path)
    assert mode(tmp_path / "api-token.json") == 0o600
    assert mode(tmp_path / "demo-keys.json") == 0o600


def test_no_window_with_a_wider_mode(tmp_path, monkeypatch):
    # Each file is created 0600 by open itself, not chmodded after its secret is in it.
    created = []
    real_open = os.open

    def recording_open(path, flags, mode=0o777, *args, **kw):
        if flags & os.O_CREAT:
            created.append((os.path.basename(path), mode))
        return real_open(path, flags, mode, *args, **kw)

    monkeypatch.setattr(os, "open", recording_open)
    devcluster._api_token(tmp_path)
    devcluster._demo_keys(tmp_path)
    devcluster.write_private(tmp_path / "cluster.json", "{}")
    assert sorted(created) == [
        ("api-token.json", 0o600),
        ("cluster.json", 0o600),
        ("demo-keys.json", 0o600),
    ]
