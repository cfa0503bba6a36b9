"""Finding and calling the operator API (and NATS) from the CLI.

Where the operator API is, in order: `--api URL`, then `LLMGW_API_URL`, then
`api_url` in the `cluster.json` that a running `llmgw dev` writes to its data
dir (`LLMGW_DATA_DIR`, default `.llmgw/` in the current directory). Its bearer
token: `--token`, then `LLMGW_API_TOKEN`, then `cluster.json`'s `api_token`, that
last only for that cluster's own API (see `find_api_token`). NATS the
same way: `--nats`, `LLMGW_NATS_URL`, `cluster.json`'s `nats_url`, then the
default local server; its TLS settings from `LLMGW_NATS_TLS__*`, then
`cluster.json`'s `nats_tls` (see `find_nats_tls`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class ApiError(RuntimeError):
    """The API could not be found, reached, or answered with an error: a message for humans."""


def data_dir() -> Path:
    return Path(os.environ.get("LLMGW_DATA_DIR") or ".llmgw")


def _cluster_file_value(key: str) -> str | None:
    path = data_dir() / "cluster.json"
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def find_api_url(explicit: str | None) -> str:
    url = explicit or os.environ.get("LLMGW_API_URL") or _cluster_file_value("api_url")
    if not url:
        raise ApiError(
            "no operator API: pass --api URL, set LLMGW_API_URL, or run `llmgw dev` "
            f"(it writes {data_dir() / 'cluster.json'})"
        )
    return url.rstrip("/")


def find_api_token(explicit: str | None, api_url: str) -> str | None:
    """The operator API token: `--token`, then `LLMGW_API_TOKEN`, then the `api_token`
    that `llmgw dev` writes to cluster.json, sent only to an API of that cluster, so a
    dev cluster's token never goes to another API the CLI is pointed at."""
    token = explicit or os.environ.get("LLMGW_API_TOKEN")
    if token:
        return token
    try:
        saved = json.loads((data_dir() / "cluster.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict):
        return None
    urls = [saved.get("api_url"), *(saved.get("api_urls") or [])]
    ours = api_url.rstrip("/") in {u.rstrip("/") for u in urls if isinstance(u, str)}
    token = saved.get("api_token")
    return token if ours and isinstance(token, str) and token else None


def find_nats_url(explicit: str | None) -> str:
    return (
        explicit
        or os.environ.get("LLMGW_NATS_URL")
        or _cluster_file_value("nats_url")
        or DEFAULT_NATS_URL
    )


def find_nats_tls(url: str):
    """TLS for the CLI's NATS connection: `LLMGW_NATS_TLS__{CA,CERT,KEY,SERVER_NAME}`,
    else the `nats_tls` that `llmgw dev --secure` writes to cluster.json (the operator's
    certificate), used only when `url` is that cluster's."""
    from llmgw.tlsconfig import NatsTLS

    keys = ("ca", "cert", "key", "server_name")
    env = {k: os.environ.get(f"LLMGW_NATS_TLS__{k.upper()}", "") for k in keys}
    if any(env.values()):
        return NatsTLS(**env)
    if url and url == _cluster_file_value("nats_url"):
        try:
            saved = json.loads((data_dir() / "cluster.json").read_text()).get("nats_tls")
        except (OSError, ValueError, AttributeError):
            saved = None
        if isinstance(saved, dict):
            return NatsTLS(**{k: str(saved[k]) for k in keys if saved.get(k)})
    return NatsTLS()


def nats_options(url: str) -> dict[str, Any]:
    """Keyword arguments for `bus.connect` (TLS and inbox prefix); ApiError if unusable."""
    from llmgw.config import ConfigError
    from llmgw.tlsconfig import nats_options as options

    try:
        return options(find_nats_tls(url))
    except ConfigError as exc:
        raise ApiError(str(exc)) from None


def add_api_argument(parser) -> None:
    parser.add_argument(
        "--api", metavar="URL", help="operator API (default: $LLMGW_API_URL, then llmgw dev's)"
    )


def add_token_argument(parser) -> None:
    parser.add_argument(
        "--token",
        metavar="TOKEN",
        help="operator API token (default: $LLMGW_API_TOKEN, then llmgw dev's)",
    )


def add_nats_argument(parser) -> None:
    parser.add_argument(
        "--nats", metavar="URL", help="NATS URL (default: $LLMGW_NATS_URL, then llmgw dev's)"
    )


def get_json(
    base_url: str, path: str, params: dict[str, Any] | None = None, token: str | None = None
) -> Any:
    """GET base_url+path as JSON; ApiError with a clear message on any failure.

    `token` is the `--token` value; without one it is found as `find_api_token` says."""
    url = base_url + path
    token = find_api_token(token, base_url)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(url, params=params, headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise ApiError(f"cannot reach the operator API at {base_url}: {exc}") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text.strip()[:200]
        if resp.status_code == 401 and token is None:
            message = f"{message} (pass --token or set LLMGW_API_TOKEN)"
        raise ApiError(f"{url}: HTTP {resp.status_code}: {' '.join(str(message).split())}")
    try:
        return resp.json()
    except ValueError:
        raise ApiError(f"{url}: the answer is not JSON") from None
