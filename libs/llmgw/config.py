"""One config loader for every service: defaults, then YAML, then LLMGW_ environment.

A service describes its config as a msgspec Struct whose fields all have
defaults. `load(Struct, path)` overlays the YAML file on those defaults, then
applies `LLMGW_<KEY>` variables (nested keys joined by `__`, e.g.
`LLMGW_ADMISSION__ENABLED=false`), then decodes into the Struct. Any problem
raises ConfigError naming the key, the value and the reason, so a service
fails at start rather than misbehaving later.

Environment values are parsed as YAML scalars ("false", "8", "[a, b]").
Variables whose first key is not a field of the Struct are ignored: the
environment is shared by every service and by the test harness.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

ENV_PREFIX = "LLMGW_"

T = TypeVar("T", bound=msgspec.Struct)


class ConfigError(ValueError):
    """An invalid config file or variable: names the key, the value and the reason."""


class ConfigStruct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base for config sections: unknown keys are errors, not silently ignored typos."""


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _field_names(cls: type[msgspec.Struct]) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(cls)}


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: the top level must be a mapping of keys, got {type(data).__name__}"
        )
    return data


def env_overrides(
    cls: type[msgspec.Struct], env: Mapping[str, str], prefix: str = ENV_PREFIX
) -> dict[str, Any]:
    known = _field_names(cls)
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(prefix):
            continue
        path = [part.lower() for part in name[len(prefix) :].split("__")]
        if not path[0] or path[0] not in known:
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: conflicts with another variable for the same key")
        node[path[-1]] = value
    return out


_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def split_validation_error(exc: msgspec.ValidationError) -> tuple[str, str | None]:
    """msgspec's message as (reason, path): the path as msgspec writes it after `$`
    (".a.b[0]"), or None when the error is about the whole value."""
    msg = str(exc)
    m = _PATH_RE.search(msg)
    return (msg[: m.start()], m["path"]) if m else (msg, None)


def lookup(data: Any, path: str) -> Any:
    """The value at a msgspec error path (".a.b[0]") in plain data, or None."""
    cur = data
    for m in re.finditer(r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]", path):
        try:
            cur = cur[m.group(1)] if m.group(1) is not None else cur[int(m.group(2))]
        except (KeyError, IndexError, TypeError):
            return None
    return cur


def convert(cls: type[T], data: Mapping[str, Any], source: str = "config") -> T:
    """Decode a mapping into `cls`, turning msgspec's error into one that names key and value."""
    try:
        return msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as exc:
        reason, path = split_validation_error(exc)
        if path is not None:
            key = path.lstrip(".") or "(top level)"
            value = lookup(data, path)
            shown = "" if value is None else f" = {value!r}"
            raise ConfigError(f"{source}: {key}{shown}: {reason}") from None
        raise ConfigError(f"{source}: {reason}") from None


def load(
    cls: type[T],
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    prefix: str = ENV_PREFIX,
) -> T:
    """Defaults < YAML file < environment < explicit overrides (e.g. CLI flags)."""
    data: dict[str, Any] = msgspec.to_builtins(cls())
    source = "config"
    if path:
        data = _merge(data, read_yaml(path))
        source = str(path)
    env_data = env_overrides(cls, os.environ if env is None else env, prefix)
    if env_data:
        data = _merge(data, env_data)
    if overrides:
        data = _merge(data, {k: v for k, v in overrides.items() if v is not None})
    return convert(cls, data, source)


def host_port(value: str, default_port: int) -> tuple[str, int]:
    """Parse 'host:port', ':port' or 'host' into a pair (for listen addresses)."""
    host, sep, port = value.rpartition(":")
    if not sep:
        return value or "127.0.0.1", default_port
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise ConfigError(f"listen address {value!r}: port {port!r} is not a number") from None
