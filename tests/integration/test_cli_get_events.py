"""`llmgw events tail` and `llmgw events export --nats` against a real stream."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess

from llmgw import bus, procs
from llmgw import contracts as c
from llmgw import subjects as s


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(procs.llmgw_argv(*args), capture_output=True, text=True, timeout=60)


async def test_export_from_the_stream_and_tail_live(js, nats_url):
    await bus.provision(js)
    first = [c.ModelDeclared(name=f"m{i}") for i in range(5)]
    for ev in first:
        await bus.publish(js, ev)
    await js.publish(s.agent_event("n1", "registered"), b"\xffnot json")

    res = await asyncio.to_thread(
        run_cli, "events", "export", "--nats", nats_url, "--from-seq", "2", "--to-seq", "6"
    )
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [e["seq"] for e in lines] == [2, 3, 4, 5, 6]
    assert [e["type"] for e in lines[:4]] == ["catalog.model.declared"] * 4
    assert lines[0]["event"]["name"] == "m1" and lines[0]["id"] == first[1].id
    assert lines[4]["event"] is None and lines[4]["error"].startswith("not JSON")

    tail = await asyncio.create_subprocess_exec(
        *procs.llmgw_argv("events", "tail", "--nats", nats_url, "--from-seq", "5"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        replayed = await asyncio.wait_for(tail.stdout.readline(), 30)
        assert replayed.split()[0] == b"5" and b"catalog.model.declared" in replayed
        assert b"name=m4" in replayed
        await asyncio.wait_for(tail.stdout.readline(), 10)  # seq 6, the junk
        await bus.publish(js, c.TenantDeclared(name="acme", band="b"))
        live = await asyncio.wait_for(tail.stdout.readline(), 10)
        assert live.split()[0] == b"7" and b"name=acme" in live and b"band=b" in live
        tail.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(tail.wait(), 10) == 0
    finally:
        if tail.returncode is None:
            tail.kill()
            await tail.wait()


def test_commands_say_when_there_is_no_api_to_read(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMGW_API_URL", raising=False)
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path / "nothing-here"))
    res = run_cli("get", "nodes")
    assert res.returncode == 1
    assert "no operator API: pass --api URL, set LLMGW_API_URL, or run `llmgw dev`" in res.stderr
    assert run_cli("get", "gpus").returncode == 2  # not a kind: usage error
