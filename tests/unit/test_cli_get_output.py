"""Operator CLI pieces: where the API is found, and how listings render."""

from __future__ import annotations

import json

import pytest

from llmgw.opcli import apiclient, events, get, output


def test_api_url_comes_from_flag_then_env_then_the_dev_cluster_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("LLMGW_API_URL", raising=False)
    monkeypatch.delenv("LLMGW_NATS_URL", raising=False)
    with pytest.raises(apiclient.ApiError, match="no operator API"):
        apiclient.find_api_url(None)
    (tmp_path / "cluster.json").write_text(
        json.dumps({"api_url": "http://dev:9300/", "nats_url": "nats://dev:4222"})
    )
    assert apiclient.find_api_url(None) == "http://dev:9300"
    assert apiclient.find_nats_url(None) == "nats://dev:4222"
    monkeypatch.setenv("LLMGW_API_URL", "http://env:1")
    assert apiclient.find_api_url(None) == "http://env:1"
    assert apiclient.find_api_url("http://flag:2") == "http://flag:2"


def test_tables_have_headers_and_aligned_columns():
    nodes = [
        {
            "node": "gpu-a", "liveness": "alive", "address": "10.0.0.1",
            "labels": {"zone": "z1", "fabric": "ib"}, "busy_gpus": ["G0"], "active_shards": 1,
            "gpus": [{"name": "H200", "memory_bytes": 141 << 30}] * 2,
        },
        {
            "node": "b", "liveness": "lost", "address": "", "labels": {},
            "busy_gpus": [], "active_shards": 0, "gpus": [],
        },
    ]  # fmt: skip
    headers, rows = get.KINDS["nodes"](nodes)
    text = output.table(headers, rows).splitlines()
    assert text[0].split() == ["NODE", "LIVENESS", "GPUS", "BUSY", "SHARDS", "ADDRESS", "LABELS"]
    assert text[1].split() == ["gpu-a", "alive", "2x", "H200", "141GiB", "1", "1", "10.0.0.1",
                               "fabric=ib,zone=z1"]  # fmt: skip
    assert text[2].split() == ["b", "lost", "0", "0", "0", "-", "-"]
    assert text[0].index("LIVENESS") == text[1].index("alive") == text[2].index("lost")


def test_readable_event_lines_show_the_identifying_fields():
    e = events.entry(
        42,
        "llmgw.evt.agent.n1.shard",
        json.dumps(
            {"type": "shard.status", "id": "x", "ts": 0, "node": "n1", "shard_id": "m-r1-s0",
             "state": "ready", "model": "m"}
        ).encode(),
    )  # fmt: skip
    line = events.readable(e)
    assert line.split()[0] == "42" and "shard.status" in line
    assert line.endswith("node=n1 model=m shard_id=m-r1-s0 state=ready")
    assert "not JSON" in events.readable(events.entry(43, "x", b"\x00"))
