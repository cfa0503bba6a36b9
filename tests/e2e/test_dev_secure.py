"""`llmgw dev --secure` as a user runs it: one real process, the whole cluster on mutual TLS.

The dev process makes a CA and certificates, writes the nats-server config with
per-identity permissions, and starts every process with its own identity. The test
reads cluster.json, checks each process runs as the identity it should (its
environment), serves a demo model through the router with the openai SDK, uses the
operator CLI with the certificate cluster.json names (on the bus and on the operator
API, which is https with client certificates), sees a client without a certificate
refused by both, then sends SIGTERM: the dev process exits 0 and leaves no process
behind, engines included. (That an agent cannot act as another node under these
permissions is tests/integration/test_nats_mtls.py's subject.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import nats
import openai
import pytest

from llmgw import procs, tlsconfig
from llmgw.agent.state import StateDir

pytestmark = pytest.mark.e2e


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"llmgw dev exited with {proc.returncode} while {what}"
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s: {what}")


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_NATS", "LLMGW_API"))}
    env["LLMGW_DATA_DIR"] = str(data_dir)
    return subprocess.run(
        procs.llmgw_argv(*args), capture_output=True, text=True, timeout=60, env=env
    )


def test_dev_secure_serves_with_every_identity_and_stops_clean(tmp_path):
    data_dir = tmp_path / "dev"
    log = (tmp_path / "dev.log").open("wb")
    dev = subprocess.Popen(
        procs.llmgw_argv(
            "dev", "--secure", "--routers", "1", "--agents", "1", "--reconcilers", "1",
            "--data-dir", str(data_dir), "--quiet",
        ),
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    log.close()
    pids: list[int] = []
    try:
        cluster_file = data_dir / "cluster.json"
        info = wait_for(
            lambda: cluster_file.exists() and json.loads(cluster_file.read_text()),
            90,
            "waiting for cluster.json",
            dev,
        )
        assert info["nats_url"].startswith("tls://")
        tls = info["nats_tls"]
        assert Path(tls["cert"]).name == "operator.crt" and Path(tls["key"]).exists()
        pids = [*info["processes"].values(), *info["servers"].values()]

        # Every process connects as its own identity.
        expected = {"reconciler-1": "reconciler", "agent-1": "agent-node-1", "router-1": "router-1"}
        for name, identity in expected.items():
            env = environ(info["processes"][name])
            assert Path(env["LLMGW_NATS_TLS__CERT"]).name == f"{identity}.crt", name
            assert Path(env["LLMGW_NATS_TLS__CA"]) == Path(tls["ca"])

        client = openai.OpenAI(base_url=info["routers"][0], api_key=info["api_key"], max_retries=0)

        def served(model: str, stream: bool = False):
            try:
                return client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4,
                    stream=stream,
                )
            except openai.APIError:  # 503 until the reconciler placed it and the engine is up
                return None

        reply = wait_for(lambda: served("demo-chat"), 90, "waiting for demo-chat", dev)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 4
        chunks = list(wait_for(lambda: served("demo-small", True), 60, "demo-small", dev))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        # The operator CLI finds its certificate through cluster.json.
        res = cli(data_dir, "events", "export", "--from-seq", "1", "--nats", info["nats_url"])
        assert res.returncode == 0, res.stderr
        types = {json.loads(line)["type"] for line in res.stdout.splitlines()}
        assert {"node.registered", "catalog.model.declared"} <= types
        res = cli(data_dir, "apply", "-f", str(data_dir / "catalog.yaml"), "--dry-run")
        assert res.returncode == 0 and "no changes" in res.stdout, res.stderr

        # The server itself refuses a client that presents no certificate (seen as the
        # TLS alert "certificate required" or as a reset connection, depending on timing).
        async def connect(**options) -> None:
            nc = await nats.connect(
                info["nats_url"], allow_reconnect=False, connect_timeout=5, **options
            )
            await nc.close()

        no_cert = ssl.create_default_context(cafile=tls["ca"])
        with pytest.raises(OSError):  # ssl.SSLError or ConnectionResetError
            asyncio.run(connect(tls=no_cert))
        asyncio.run(connect(**tlsconfig.nats_options(tlsconfig.NatsTLS(**tls))))  # the control

        # The operator API is https and asks for a client certificate too; the CLI finds
        # the operator's, the URL and the token in cluster.json alone.
        assert all(url.startswith("https://") for url in info["api_urls"])
        assert info["api_tls"] == tls
        res = cli(data_dir, "get", "models")
        assert res.returncode == 0, res.stderr
        assert {"demo-chat", "demo-small"} <= {line.split()[0] for line in res.stdout.splitlines()}
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{info['api_url']}/healthz", verify=no_cert, timeout=5)

        def engines() -> list[int]:
            return [
                rec.pid
                for rec in StateDir(data_dir / "agent-1").load_all()
                if rec.pid and not gone(rec.pid)
            ]

        # demo-chat x2, demo-small (the second demo-chat may still be starting: it need
        # not serve for the requests above to succeed)
        pids += wait_for(lambda: e if len(e := engines()) == 3 else None, 60, "three engines", dev)

        dev.send_signal(signal.SIGTERM)
        assert dev.wait(60) == 0, (tmp_path / "dev.log").read_text()[-3000:]
        left = [pid for pid in pids if pid and not gone(pid)]
        assert left == [], f"still running: {left}"
        assert not cluster_file.exists()
    finally:
        if dev.poll() is None:  # a failed run: let llmgw dev stop its cluster, then make sure
            dev.send_signal(signal.SIGTERM)
            try:
                dev.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(dev.pid, signal.SIGKILL)
                dev.wait(10)
        with contextlib.suppress(OSError):
            pids += [rec.pid for rec in StateDir(data_dir / "agent-1").load_all() if rec.pid]
        for pid in pids:
            if pid and not gone(pid):
                os.kill(pid, signal.SIGKILL)
