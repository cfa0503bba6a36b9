"""The router's config file: what it accepts, and every rejection naming its entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.cli import main as llmgw_main
from llmgw.config import ConfigError
from llmgw.router import config as rc

GOOD = """
listen: 127.0.0.1:8080
admin_listen: 127.0.0.1:9090
models:
  - name: m
    aliases: [m-latest]
    fallbacks: [m-small]
  - name: m-small
endpoints:
  - id: e1
    url: http://127.0.0.1:8001
    models: [m]
  - id: e2
    url: http://127.0.0.1:8002/
    models: [m, m-small]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "router.yaml"
    p.write_text(text)
    return p


def problems_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        rc.load(write(tmp_path, text))
    return str(err.value)


def test_the_issue_example_loads_and_projects_per_model_records(tmp_path):
    config = rc.load(write(tmp_path, GOOD))
    records = {r.model: r for r in rc.projection(config)}
    assert [e.id for e in records["m"].endpoints] == ["e1", "e2"]
    assert [e.id for e in records["m-small"].endpoints] == ["e2"]
    assert records["m"].aliases == ["m-latest"]
    assert records["m"].fallbacks == ["m-small"]
    assert records["m-small"].endpoints[0].url == "http://127.0.0.1:8002"  # trailing / dropped


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "models: [{name: m}]\nendpoints:\n"
            "  - {id: e1, url: 'http://a:1', models: [m]}\n"
            "  - {id: e1, url: 'http://b:1', models: [m]}\n",
            "endpoints[1] (id 'e1'): duplicate endpoint id, first used by endpoints[0]",
        ),
        (
            "models: [{name: m, aliases: [n]}, {name: n}]\n",
            "model 'm': alias 'n' shadows model 'n'",
        ),
        (
            "models: [{name: m, aliases: [x]}, {name: n, aliases: [x]}]\n",
            "model 'n': alias 'x' is already an alias of model 'm'",
        ),
        (
            "models: [{name: m, fallbacks: [nope]}]\n",
            "model 'm': fallback 'nope' is not a declared model or alias",
        ),
        (
            "models: [{name: a, fallbacks: [b]}, {name: b, fallbacks: [c]}, {name: c, fallbacks: [a]}]\n",
            "fallbacks form a cycle: a -> b -> c -> a",
        ),
        (
            "models: [{name: m}]\nendpoints: [{id: e1, url: 'http://a:1', models: [ghost]}]\n",
            "endpoints[0] (id 'e1'): serves unknown model 'ghost'",
        ),
        (
            "models: [{name: m, scheduling: {pickr: p2c}}]\n",
            "models[0].scheduling.pickr: unknown key",
        ),
        (
            "models: [{name: m, scheduling: {scorers: {vibes: 1}}}]\n",
            "model 'm': scheduling.scorers: unknown scorer 'vibes'",
        ),
        (
            "models: [{name: m, scheduling: {picker: best}}]\n",
            "model 'm': scheduling.picker: unknown picker 'best'",
        ),
        (
            "models: [{name: m, scheduling: {filters: [warm]}}]\n",
            "model 'm': scheduling.filters: unknown filter 'warm'",
        ),
        (
            "models: [{name: m, deadlines: {idle: 0}}]\n",
            "model 'm': deadlines.idle = 0.0: must be positive",
        ),
        (
            "models: [{name: m}]\nendpoints: [{id: e1, url: 'ftp://a', models: [m]}]\n",
            "endpoints[0] (id 'e1'): url 'ftp://a' is not an http(s) URL with a host",
        ),
        ("workers: 0\n", "workers = 0: must be at least 1"),
        ("models: [{name: m, colour: red}]\n", "colour"),
    ],
)
def test_invalid_files_are_rejected_naming_the_entry(tmp_path, text, expected):
    assert expected in problems_of(tmp_path, text)


def test_every_problem_is_reported_at_once(tmp_path):
    text = (
        "models: [{name: m, aliases: [m2]}, {name: m2, fallbacks: [zz]}]\n"
        "endpoints: [{id: e, url: 'http://a:1', models: [q]}, {id: e, url: 'http://a:2', models: [m]}]\n"
    )
    message = problems_of(tmp_path, text)
    assert "alias 'm2' shadows model 'm2'" in message
    assert "fallback 'zz'" in message
    assert "serves unknown model 'q'" in message
    assert "duplicate endpoint id" in message


def test_model_sections_override_model_defaults_key_by_key(tmp_path):
    config = rc.load(
        write(
            tmp_path,
            "model_defaults:\n"
            "  deadlines: {idle: 5, total: 100}\n"
            "  scheduling: {picker: p2c}\n"
            "models:\n"
            "  - name: a\n"
            "    deadlines: {idle: 1}\n"
            "  - name: b\n",
        )
    )
    records = {r.model: r for r in rc.projection(config)}
    assert records["a"].deadlines.idle == 1
    assert records["a"].deadlines.total == 100  # from model_defaults, not the built-in 600
    assert records["b"].deadlines.idle == 5
    assert records["a"].scheduling.picker == "p2c"


def test_environment_overrides_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_RETRY__ATTEMPTS_PER_MODEL", "5")
    config = rc.load(write(tmp_path, GOOD))
    assert config.retry.attempts_per_model == 5


def test_cli_check_exits_0_for_a_good_file_and_2_naming_problems(tmp_path, capsys):
    good = write(tmp_path, GOOD)
    assert llmgw_main(["router", "--config", str(good), "--check"]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [{name: m, aliases: [m]}]\n")
    assert llmgw_main(["router", "--config", str(bad), "--check"]) == 2
    assert "alias 'm' shadows model 'm'" in capsys.readouterr().err
    assert llmgw_main(["router", "--config", str(tmp_path / "missing.yaml")]) == 2
