from pathlib import Path

import msgspec
import pytest

from llmgw import config


class Inner(config.ConfigStruct):
    enabled: bool = True
    limit: int = 10


class Sample(config.ConfigStruct):
    listen: str = "127.0.0.1:8080"
    workers: int = 1
    inner: Inner = msgspec.field(default_factory=Inner)
    tags: list[str] = []


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_then_yaml_then_env_then_overrides(tmp_path):
    path = write(tmp_path, "workers: 3\ninner:\n  limit: 20\n")
    env = {"LLMGW_INNER__ENABLED": "false", "LLMGW_TAGS": "[a, b]", "LLMGW_WORKERS": "4"}
    cfg = config.load(Sample, path, env=env, overrides={"listen": ":9000", "workers": None})
    assert cfg.workers == 4  # env beats file
    assert cfg.inner.limit == 20 and cfg.inner.enabled is False
    assert cfg.tags == ["a", "b"]
    assert cfg.listen == ":9000"  # flags beat everything; None means "flag not given"


def test_env_for_other_services_is_ignored(tmp_path):
    cfg = config.load(Sample, None, env={"LLMGW_TEST_NATS_URL": "nats://x", "LLMGW_": "1"})
    assert cfg == Sample()


def test_bad_value_in_file_names_key_value_and_reason(tmp_path):
    path = write(tmp_path, "inner:\n  limit: lots\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(Sample, path, env={})
    msg = str(info.value)
    assert "inner.limit" in msg and "'lots'" in msg and "int" in msg and str(path) in msg


def test_bad_env_value_names_the_key():
    with pytest.raises(config.ConfigError) as info:
        config.load(Sample, None, env={"LLMGW_WORKERS": "many"})
    assert "workers" in str(info.value) and "'many'" in str(info.value)


def test_unknown_key_is_an_error_not_a_silent_typo(tmp_path):
    path = write(tmp_path, "inner:\n  limt: 3\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(Sample, path, env={})
    assert "limt" in str(info.value)


@pytest.mark.parametrize("text, needle", [("- a\n- b\n", "mapping"), ("a: [\n", "YAML")])
def test_malformed_files_are_reported(tmp_path, text, needle):
    with pytest.raises(config.ConfigError, match=needle):
        config.load(Sample, write(tmp_path, text), env={})


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(config.ConfigError, match="cannot read"):
        config.load(Sample, tmp_path / "nope.yaml", env={})


def test_host_port():
    assert config.host_port("0.0.0.0:81", 80) == ("0.0.0.0", 81)
    assert config.host_port(":81", 80) == ("127.0.0.1", 81)
    assert config.host_port("h", 80) == ("h", 80)
    with pytest.raises(config.ConfigError):
        config.host_port("h:x", 80)
