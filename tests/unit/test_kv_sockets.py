"""The agent's KV event sockets: short ipc:// paths in a directory only its user enters."""

from __future__ import annotations

import os
import stat

import pytest

from llmgw.agent import kvsockets
from llmgw.agent.kvrelay import KvRelays
from llmgw.agent.state import StateDir


def test_the_state_dir_makes_its_socket_directory_private(tmp_path):
    (tmp_path / "kv").mkdir(mode=0o755)  # left by hand, or an older agent: made private
    sd = StateDir(tmp_path).open()
    try:
        assert sd.kv_sockets == tmp_path / "kv"
        assert stat.S_IMODE(os.stat(sd.kv_sockets).st_mode) == 0o700
    finally:
        sd.close()


def test_each_shard_has_two_short_ipc_endpoints_of_its_own(tmp_path):
    events, replay = kvsockets.endpoints(tmp_path, "model-replica-1-shard-0" * 10)
    assert events.startswith(f"ipc://{tmp_path}/") and events.endswith(".ev")
    assert replay == events[: -len(".ev")] + ".rp"
    assert len(events) - len(f"ipc://{tmp_path}/") == 15  # however long the shard id
    assert kvsockets.endpoints(tmp_path, "other")[0] != events


def test_a_state_dir_too_deep_for_a_socket_path_is_refused_naming_it(tmp_path):
    deep = tmp_path / ("d" * (kvsockets.MAX_SOCKET_PATH - len(str(tmp_path)) - 10)) / "kv"
    with pytest.raises(kvsockets.SocketDirError, match="state dir too deep"):
        kvsockets.prepare(deep)
    assert not deep.exists()


def test_a_socket_directory_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "kv").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(kvsockets.SocketDirError, match="not a directory of this user"):
        kvsockets.prepare(tmp_path / "kv")


def test_pruning_keeps_only_the_live_engines_sockets(tmp_path):
    live = kvsockets.endpoints(tmp_path, "live")
    dead = kvsockets.endpoints(tmp_path, "dead")
    for endpoint in (*live, *dead):
        open(endpoint.removeprefix("ipc://"), "w").close()
    kvsockets.prune(tmp_path, set(live))
    assert sorted(os.listdir(tmp_path)) == sorted(e.rsplit("/", 1)[1] for e in live)


async def test_a_relay_connects_to_its_shards_endpoints_or_the_ones_given(tmp_path):
    relays = KvRelays("n1", tmp_path)
    try:
        relay = relays.open("s1")
        assert (relay.endpoint, relay.replay_endpoint) == kvsockets.endpoints(tmp_path, "s1")
        adopted = relays.open("s2", ("ipc:///elsewhere/a.ev", "ipc:///elsewhere/a.rp"))
        assert adopted.endpoint == "ipc:///elsewhere/a.ev"
        assert adopted.replay_endpoint == "ipc:///elsewhere/a.rp"
    finally:
        await relays.stop()
