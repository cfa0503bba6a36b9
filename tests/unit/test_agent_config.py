"""Agent configuration: flags over env over file, and clear errors."""

import argparse

import pytest

from llmgw.agent import cli
from llmgw.agent.config import (
    AgentConfig,
    parse_labels,
    parse_port_range,
    resolve_node_id,
    resolve_state_dir,
)
from llmgw.config import ConfigError


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(list(argv))


def test_port_range():
    assert parse_port_range("8100-8199") == range(8100, 8200)
    assert parse_port_range("9000") == range(9000, 9001)
    for bad in ("x-y", "9000-8000", "0-10", "8100-70000"):
        with pytest.raises(ConfigError, match="engine_port_range"):
            parse_port_range(bad)


def test_labels():
    assert parse_labels("fabric=ib-a, zone=z1") == {"fabric": "ib-a", "zone": "z1"}
    assert parse_labels("") == {}
    with pytest.raises(ConfigError, match="'fabric' is not KEY=VALUE"):
        parse_labels("fabric")


def test_flags_override_file_and_environment(tmp_path, monkeypatch):
    f = tmp_path / "agent.yaml"
    f.write_text("node_id: from-file\nlabels: {zone: z9}\nheartbeat_interval_seconds: 5\n")
    monkeypatch.setenv("LLMGW_HEARTBEAT_INTERVAL_SECONDS", "3")
    monkeypatch.setenv("LLMGW_FAKE_GPUS", "4x24GiB")
    cfg = cli.load_config(args("--config", str(f), "--node-id", "n7", "--labels", "fabric=ib-a"))
    assert cfg.node_id == "n7"
    assert cfg.labels == {"zone": "z9", "fabric": "ib-a"}  # flag labels merge over the file's
    assert cfg.heartbeat_interval_seconds == 3 and cfg.fake_gpus == "4x24GiB"


def test_bad_values_are_named(tmp_path):
    with pytest.raises(ConfigError, match="engine_port_range"):
        cli.load_config(args("--engine-port-range", "abc"))
    with pytest.raises(ConfigError, match="heartbeat_interval_seconds"):
        cli.load_config(args("--heartbeat-interval", "0"))
    f = tmp_path / "agent.yaml"
    f.write_text("no_such_key: 1\n")
    with pytest.raises(ConfigError, match="no_such_key"):
        cli.load_config(args("--config", str(f)))


def test_node_id_must_fit_a_subject():
    assert resolve_node_id(AgentConfig(node_id="gpu-01")) == "gpu-01"
    with pytest.raises(ConfigError, match="node_id"):
        resolve_node_id(AgentConfig(node_id="gpu.01"))
    assert resolve_node_id(AgentConfig())  # the host name, made safe


def test_state_dir_default_is_per_node(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert resolve_state_dir(AgentConfig(), "n1") == tmp_path / "llmgw" / "agent-n1"
    assert resolve_state_dir(AgentConfig(state_dir="/x"), "n1").as_posix() == "/x"


def test_bad_config_exits_2(capsys):
    assert cli.run(args("--engine-port-range", "abc")) == 2
    assert "engine_port_range" in capsys.readouterr().err


def test_admin_listen_defaults_to_loopback_and_can_be_turned_off(monkeypatch):
    assert cli.load_config(args()).admin_listen == "127.0.0.1:9410"
    assert cli.load_config(args("--admin-listen", "")).admin_listen == ""
    monkeypatch.setenv("LLMGW_ADMIN_LISTEN", "0.0.0.0:9411")
    assert cli.load_config(args()).admin_listen == "0.0.0.0:9411"
    with pytest.raises(ConfigError, match="admin_listen: .*port 'y' is not a number"):
        cli.load_config(args("--admin-listen", "x:y"))


def test_engine_ports_go_round_the_range_so_a_freed_port_is_not_reused_at_once():
    from llmgw.agent.launcher import next_port

    ports = parse_port_range("8100-8103")
    free = {8100, 8101, 8102, 8103}
    assert next_port(ports, set(), None, free.__contains__) == 8100
    assert next_port(ports, {8100}, 8100, free.__contains__) == 8101
    # 8100's engine stopped and 8101 is held: the next engine gets 8102, not 8100.
    assert next_port(ports, {8101}, 8101, free.__contains__) == 8102
    # After the last port it wraps, skipping held ports and ports another process binds.
    free.discard(8100)
    assert next_port(ports, {8101, 8102}, 8103, free.__contains__) == 8103
    assert next_port(ports, {8101, 8102, 8103}, 8103, free.__contains__) is None


def test_an_engine_port_is_never_one_a_live_shards_record_holds():
    """Engines bind their ports only once the model is loaded: a port recorded for
    another shard is free to the kernel, but not to give out. (KV event sockets are
    ipc:// paths, no ports.)"""
    from llmgw.agent.launcher import held_ports, next_port
    from llmgw.agent.state import ShardRecord

    loading = ShardRecord(shard_id="a", model="m", replica_id="r", shard_index=0, engine="sim")
    loading.port, loading.kv_events_endpoint = 8101, "ipc:///s/kv/a.ev"
    ports = parse_port_range("8100-8102")
    assert held_ports([loading]) == {8101}
    assert next_port(ports, held_ports([loading]), 8100, lambda p: True) == 8102
