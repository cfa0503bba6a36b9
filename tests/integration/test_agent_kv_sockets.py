"""No other user reaches an agent's KV event sockets (issue #25, least privilege).

The relay's socket takes events that steer every router's prefix routing and the engine's
replay socket hands out its block history: both are Unix sockets in the agent's state
dir, in a directory only the agent's user can enter. Tests run as root, which no file
mode stops, so the other user is a child process switched to `nobody`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import httpx
import pytest

from llmgw import bus, kvblocks
from llmgw.kvblocks import byte_tokens

from . import test_agent_lifecycle as life
from .test_agent_kv_events import PROMPT, agent_on
from .test_agent_lifecycle import S, agent_config, start_cmd, status

watch = life.watch  # the fixture

NOBODY = 65534


def as_nobody(directory: Path, sockets: list[Path]) -> list[str]:
    """What user `nobody` gets: "reached" when it can look at `directory` (so only the
    directory's own mode can stop it further), then for each socket "connected" or the
    name of the error a plain AF_UNIX connect raises."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then out without any cleanup
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            said = []
            try:
                os.stat(directory)
                said.append("reached")
            except OSError as exc:
                said.append(type(exc).__name__)
            for path in sockets:
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                        sock.connect(str(path))
                    said.append("connected")
                except OSError as exc:
                    said.append(type(exc).__name__)
            os.write(write, " ".join(said).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out.split()


@pytest.fixture
def open_state_dir():
    """A state dir every user can reach, as /var/lib's are: only the socket directory's
    own mode keeps another user out. (pytest's tmp_path is under a root-only directory.)"""
    base = Path(tempfile.mkdtemp(prefix="kvs"))
    try:
        base.chmod(0o755)
        (base / "state").mkdir(mode=0o755)
        (base / "state").chmod(0o755)
        yield base / "state"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
async def test_another_user_reaches_neither_kv_socket_and_the_agent_still_relays_and_replays(
    nats, nats_url, watch, open_state_dir
):
    js = nats.jetstream()
    cfg = agent_config("n-kvs", nats_url, open_state_dir)
    async with agent_on(cfg) as (agent, _):
        await bus.publish(js, start_cmd("n-kvs", "kvs"))
        ready = await watch.wait_for(status("kvs", S.READY))
        rec = agent.shards["kvs"].rec
        relay = agent.kv_relays.relays["kvs"]

        # Both endpoints are Unix sockets the engine bound, in a 0700 directory of the
        # agent's user inside its state dir; the engine was told both.
        kv_dir = open_state_dir / "kv"
        paths = []
        for endpoint in (rec.kv_events_endpoint, rec.kv_replay_endpoint):
            assert endpoint.startswith("ipc://"), endpoint
            path = Path(endpoint.removeprefix("ipc://"))
            assert path.parent == kv_dir and stat.S_ISSOCK(os.stat(path).st_mode)
            assert endpoint in " ".join(rec.argv)
            paths.append(path)
        assert (relay.endpoint, relay.replay_endpoint) == (
            rec.kv_events_endpoint,
            rec.kv_replay_endpoint,
        )
        info = os.stat(kv_dir)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()

        # Another user gets as far as the directory, and no further.
        said = await asyncio.to_thread(as_nobody, kv_dir, paths)
        assert said == ["reached", "PermissionError", "PermissionError"]

        # The agent's own relay still gets the engine's events...
        async def complete(prompt: str) -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                r = await client.post(
                    f"{ready.url}/v1/completions",
                    json={"model": "model-kvs", "prompt": prompt, "max_tokens": 1},
                )
                r.raise_for_status()

        def hashes(prompt: str) -> set[int]:
            return set(kvblocks.prompt_hashes(byte_tokens(prompt.encode()), 16, 1000))

        async def until(predicate, what: str) -> None:
            for _ in range(400):
                if predicate():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"{what}: not within 20 s")

        first, lost, last = PROMPT, PROMPT.replace("same", "lost"), PROMPT.replace("same", "last")
        await complete(first)
        await until(lambda: hashes(first) <= set(relay.blocks.hashes()), "events relayed")

        # ...and still asks the engine's replay socket for batches it missed: some of one
        # request's batches are dropped on their way in, a later batch shows the gap.
        live, dropped = relay.receive, []

        def lossy(parts: list[bytes]) -> None:
            if dropped is not None:
                dropped.append(parts)
            else:
                live(parts)

        relay.receive = lossy  # type: ignore[method-assign]
        await complete(lost)
        await until(lambda: dropped, "a batch dropped")
        dropped = None
        await complete(last)
        expected = hashes(first) | hashes(lost) | hashes(last)
        await until(lambda: expected <= set(relay.blocks.hashes()), "the gap replayed")
        assert relay.replayed >= 1 and relay.engine_gaps == 0
