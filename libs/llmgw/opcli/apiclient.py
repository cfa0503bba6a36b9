"""Finding and calling the operator API (and NATS) from the CLI.

Where the operator API is, in order: `--api URL`, then `LLMGW_API_URL`, then
`api_url` in the `cluster.json` that a running `llmgw dev` writes to its data
dir (`LLMGW_DATA_DIR`, default `.llmgw/` in the current directory). Its bearer
token: `--token`, then `LLMGW_API_TOKEN`, then `cluster.json`'s `api_token`, that
last only for that cluster's own API (see `find_api_token`). For an https
API, the client certificate and CA: `--api-cert/--api-key/--api-ca`, then
`LLMGW_API_TLS__{CERT,KEY,CA}`, then `cluster.json`'s `api_tls` (the
operator's certificate, which `llmgw dev --secure` writes), that last again
only for that cluster's API (see `find_api_tls`). NATS the same way: `--nats`, `LLMGW_NATS_URL`, `cluster.json`'s `nats_url`, then the
default local server; its TLS settings from `LLMGW_NATS_TLS__*`, then
`cluster.json`'s `nats_tls` (see `find_nats_tls`).
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import httpx

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class ApiError(RuntimeError):
    """The API could not be found, reached, or answered with an error: a message for humans."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status the API answered, None when it did not answer


@dataclass(frozen=True)
class ApiTLS:
    """The client side of the operator API's mutual TLS (files; all empty: none)."""

    ca: str = ""  # CA that signed the API's server certificate; "": the system's
    cert: str = ""  # client certificate the listener asks for
    key: str = ""

    def __bool__(self) -> bool:
        return any((self.ca, self.cert, self.key))


def data_dir() -> Path:
    return Path(os.environ.get("LLMGW_DATA_DIR") or ".llmgw")


def _cluster_info() -> dict[str, Any]:
    """What a running `llmgw dev` wrote to its cluster.json; {} when there is none."""
    try:
        info = json.loads((data_dir() / "cluster.json").read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _cluster_file_value(key: str) -> str | None:
    value = _cluster_info().get(key)
    return value if isinstance(value, str) and value else None


def find_api_url(explicit: str | None) -> str:
    url = explicit or os.environ.get("LLMGW_API_URL") or _cluster_file_value("api_url")
    if not url:
        raise ApiError(
            "no operator API: pass --api URL, set LLMGW_API_URL, or run `llmgw dev` "
            f"(it writes {data_dir() / 'cluster.json'})"
        )
    return url.rstrip("/")


def _saved_for(api_url: str, key: str) -> object:
    """`key` from the dev cluster's cluster.json if `api_url` is one of that cluster's
    APIs, else None: what the file holds for its cluster never goes to another API."""
    saved = _cluster_info()
    urls = [saved.get("api_url"), *(saved.get("api_urls") or [])]
    ours = api_url.rstrip("/") in {u.rstrip("/") for u in urls if isinstance(u, str)}
    return saved.get(key) if ours else None


def find_api_token(explicit: str | None, api_url: str) -> str | None:
    """The operator API token: `--token`, then `LLMGW_API_TOKEN`, then the `api_token`
    that `llmgw dev` writes to cluster.json, sent only to an API of that cluster, so a
    dev cluster's token never goes to another API the CLI is pointed at."""
    token = explicit or os.environ.get("LLMGW_API_TOKEN")
    if token:
        return token
    token = _saved_for(api_url, "api_token")
    return token if isinstance(token, str) and token else None


def find_api_tls(explicit: ApiTLS | None, api_url: str) -> ApiTLS:
    """The API's TLS files: the `--api-*` flags, then `LLMGW_API_TLS__{CA,CERT,KEY}`, then
    the `api_tls` that `llmgw dev --secure` writes to cluster.json, for that cluster's
    API only. Each source is taken whole, never mixed with another."""
    if explicit:
        return explicit
    names = [f.name for f in fields(ApiTLS)]
    env = ApiTLS(**{k: os.environ.get(f"LLMGW_API_TLS__{k.upper()}", "") for k in names})
    if env:
        return env
    saved = _saved_for(api_url, "api_tls")
    if isinstance(saved, dict):
        return ApiTLS(**{k: str(saved[k]) for k in names if saved.get(k)})
    return ApiTLS()


def api_verify(tls: ApiTLS) -> ssl.SSLContext:
    """httpx's `verify` for an https API: `tls`'s CA, presenting its certificate."""
    from llmgw.config import ConfigError
    from llmgw.tlsconfig import client_context

    try:
        return client_context(tls.ca, tls.cert, tls.key, "api_tls")
    except ConfigError as exc:
        raise ApiError(f"operator API TLS: {exc}") from None


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
    saved = _cluster_info()
    if url and url == saved.get("nats_url"):
        saved = saved.get("nats_tls")
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


def add_api_tls_arguments(parser) -> None:
    group = parser.add_argument_group("operator API over mutual TLS (https URLs)")
    group.add_argument(
        "--api-cert",
        metavar="FILE",
        help="client certificate (default: $LLMGW_API_TLS__CERT, then llmgw dev's)",
    )
    group.add_argument("--api-key", metavar="FILE", help="its key ($LLMGW_API_TLS__KEY)")
    group.add_argument(
        "--api-ca", metavar="FILE", help="CA of the API's certificate ($LLMGW_API_TLS__CA)"
    )


def api_tls_flags(args) -> ApiTLS:
    """What the `--api-*` TLS flags say (all empty when none was given)."""
    return ApiTLS(ca=args.api_ca or "", cert=args.api_cert or "", key=args.api_key or "")


def add_nats_argument(parser) -> None:
    parser.add_argument(
        "--nats", metavar="URL", help="NATS URL (default: $LLMGW_NATS_URL, then llmgw dev's)"
    )


def _ssl_cause(exc: BaseException) -> ssl.SSLError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def transport_failure(base_url: str, exc: httpx.TransportError, tls: ApiTLS) -> str:
    """One line for an API that could not be talked to, saying what TLS has to do with it.

    A listener that refuses a client certificate (or gets none) under TLS 1.3 just
    closes the connection after the handshake, so on https a disconnect counts as TLS."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    dropped = isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError)
    if base_url.startswith("https:") and (_ssl_cause(exc) is not None or dropped):
        hint = (
            ""
            if tls.cert and tls.ca
            else " (its client certificate and CA: --api-cert/--api-key/--api-ca or "
            "LLMGW_API_TLS__*)"
        )
        return f"TLS with the operator API at {base_url} failed: {reason}{hint}"
    if dropped:
        reason += " (a reconciler with admin_tls answers only https)"
    return f"cannot reach the operator API at {base_url}: {reason}"


def get_json(
    base_url: str,
    path: str,
    params: dict[str, Any] | None = None,
    token: str | None = None,
    tls: ApiTLS | None = None,
) -> Any:
    """GET base_url+path as JSON; ApiError with a clear message on any failure.

    `token` is the `--token` value, `tls` the `--api-*` flags'; without them each is
    found as `find_api_token` and `find_api_tls` say."""
    url = base_url + path
    token = find_api_token(token, base_url)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    tls = find_api_tls(tls, base_url)
    verify: ssl.SSLContext | bool = api_verify(tls) if base_url.startswith("https:") else True
    try:
        resp = httpx.get(url, params=params, headers=headers, timeout=10.0, verify=verify)
    except httpx.TransportError as exc:
        raise ApiError(transport_failure(base_url, exc, tls)) from None
    except httpx.HTTPError as exc:
        raise ApiError(f"cannot reach the operator API at {base_url}: {exc}") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text.strip()[:200]
        if resp.status_code == 401 and token is None:
            message = f"{message} (pass --token or set LLMGW_API_TOKEN)"
        message = " ".join(str(message).split())
        raise ApiError(f"{url}: HTTP {resp.status_code}: {message}", resp.status_code)
    try:
        return resp.json()
    except ValueError:
        raise ApiError(f"{url}: the answer is not JSON") from None
