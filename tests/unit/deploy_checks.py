"""Checks shared by the deploy tests: a command line or an environment against the code.

Deploy files name subcommands, flags and `LLMGW_*` variables as plain strings;
these helpers hold them against the real argparse parsers and config Structs,
so a renamed flag or key fails a test instead of a container at start.

Where the code a file relies on has not landed yet (a service's CLI or config
module, a key another issue adds), the check is xfailed with a reason naming
what is missing, never skipped silently; it turns into a pass by itself once
the code is there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import typing
from pathlib import Path

import msgspec
import pytest

from llmgw import cli, config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Which config Struct a subcommand's LLMGW_* variables must map to.
CONFIGS: dict[str, tuple[str, str]] = {
    "router": ("llmgw.router.config", "RouterConfig"),
    "reconciler": ("llmgw.reconciler.config", "ReconcilerConfig"),
    # `llmgw migrate` reads LLMGW_DATABASE_URL, the reconciler's database_url.
    "migrate": ("llmgw.reconciler.config", "ReconcilerConfig"),
    "agent": ("llmgw.agent.config", "AgentConfig"),
    "sim-engine": ("llmgw.simengine.config", "SimConfig"),
}

# Keys the deploy files already use for work another issue adds. Each is xfailed
# while the key is missing and checked like any other once it exists.
PENDING_KEYS: dict[tuple[str, str], str] = {
    ("reconciler", "nats_tls"): "ReconcilerConfig has no nats_tls section yet",
    ("agent", "nats_tls"): "AgentConfig has no nats_tls section yet",
}


def _missing_module(module: str) -> str | None:
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    return None if found else module


def parse_command(argv: list[str]) -> argparse.Namespace:
    """Parse `llmgw <argv>` with the real parser; xfail if the command's module is missing."""
    assert argv, "empty command"
    sub = argv[0]
    assert sub in cli.COMMANDS, f"{sub!r} is not an llmgw subcommand ({', '.join(cli.COMMANDS)})"
    missing = _missing_module(cli.COMMANDS[sub][0])
    if missing:
        pytest.xfail(f"`llmgw {sub}` is not built yet: module {missing} is missing")
    parser = cli.build_parser(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`llmgw {' '.join(argv)}` is rejected by its parser:\n{err.getvalue()}")


def config_class(subcommand: str) -> type[msgspec.Struct]:
    module, name = CONFIGS[subcommand]
    missing = _missing_module(module)
    if missing:
        pytest.xfail(f"{subcommand}'s config module {missing} is missing")
    return getattr(importlib.import_module(module), name)


def _struct_type(tp) -> type[msgspec.Struct] | None:
    for cand in (tp, *typing.get_args(tp)):
        if isinstance(cand, type) and issubclass(cand, msgspec.Struct):
            return cand
    return None


def _is_mapping(tp) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def key_exists(cls: type[msgspec.Struct], path: list[str]) -> bool:
    """Whether the nested key `path` (from an LLMGW_A__B variable) is a field of `cls`."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
    head, rest = path[0], path[1:]
    if head not in fields:
        return False
    if not rest:
        return True
    tp = fields[head].type
    if _is_mapping(tp):
        return True
    inner = _struct_type(tp)
    return inner is not None and key_exists(inner, rest)


def check_environment(subcommand: str, env: dict[str, str], where: str) -> None:
    """Every LLMGW_* variable is a key of the service's config, and the values decode."""
    llmgw_env = {k: str(v) for k, v in env.items() if k.startswith(config.ENV_PREFIX)}
    if not llmgw_env:
        return
    cls = config_class(subcommand)
    pending: dict[str, str] = {}
    for name in llmgw_env:
        path = [p.lower() for p in name[len(config.ENV_PREFIX) :].split("__")]
        if key_exists(cls, path):
            continue
        top_level_missing = not key_exists(cls, path[:1])
        reason = PENDING_KEYS.get((subcommand, path[0])) if top_level_missing else None
        if reason is None:
            pytest.fail(f"{where}: {name} is not a key of {cls.__name__}")
        pending[name] = reason
    known = {k: v for k, v in llmgw_env.items() if k not in pending}
    try:
        config.load(cls, None, env=known)
    except config.ConfigError as exc:
        pytest.fail(f"{where}: its LLMGW_* values do not load: {exc}")
    if pending:
        pytest.xfail("; ".join(f"{k}: {v}" for k, v in pending.items()))


def http_port(url: str) -> int:
    m = re.search(r"://[^/:]+:(\d+)", url)
    assert m, f"no port in {url!r}"
    return int(m.group(1))


def metric_names_in_code() -> set[str]:
    """Every llmgw_* metric name that appears as a string in the services' source."""
    names: set[str] = set()
    for path in (ROOT / "services").rglob("*.py"):
        names |= set(re.findall(r"[\"'](llmgw_[a-z0-9_]+)[\"']", path.read_text()))
    return names
