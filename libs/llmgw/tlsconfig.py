"""TLS settings for a service's NATS connection, as one config section.

A service adds the section to its config Struct:

    class RouterConfig(config.ConfigStruct, kw_only=True):
        nats_url: str = "nats://127.0.0.1:4222"
        nats_tls: tlsconfig.NatsTLS = msgspec.field(default_factory=tlsconfig.NatsTLS)

and connects with

    nc = await bus.connect(cfg.nats_url, "router", **tlsconfig.nats_options(cfg.nats_tls))

In YAML that is `nats_tls: {ca: ..., cert: ..., key: ...}`; in the
environment `LLMGW_NATS_TLS__CA`, `LLMGW_NATS_TLS__CERT`, `LLMGW_NATS_TLS__KEY`.
With no `ca` the section is off and the connection is plain.

`nats_options` also sets the client's inbox prefix to `_INBOX.<identity>`,
the identity being the certificate's common name: the server config from
`llmgw nats-config` lets each identity subscribe only under its own prefix,
so replies meant for one identity cannot be read by another.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from cryptography import x509

from llmgw import config
from llmgw.certs import CA_NAME, common_name
from llmgw.natsconfig import inbox_prefix


class NatsTLS(config.ConfigStruct, kw_only=True):
    ca: str = ""  # CA bundle that signed the server certificate; empty: TLS off
    cert: str = ""  # client certificate (mutual TLS); needs `key`
    key: str = ""
    server_name: str = ""  # name to verify on the server certificate, if not the URL's host

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)


def from_certs_dir(directory: str | Path, identity: str) -> NatsTLS:
    """The section for `identity` in a folder made by `llmgw certs init`."""
    d = Path(directory)
    return NatsTLS(
        ca=str(d / f"{CA_NAME}.crt"),
        cert=str(d / f"{identity}.crt"),
        key=str(d / f"{identity}.key"),
    )


def _readable(path: str, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise config.ConfigError(f"nats_tls.{what} = {path!r}: no such file")
    return p


def ssl_context(tls: NatsTLS) -> ssl.SSLContext:
    """A client context that verifies the server against `ca` and presents `cert`/`key`."""
    if not tls.ca:
        raise config.ConfigError("nats_tls.ca: required when nats_tls.cert is set")
    if bool(tls.cert) != bool(tls.key):
        raise config.ConfigError("nats_tls: cert and key must be given together")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(_readable(tls.ca, "ca")))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert:
        try:
            ctx.load_cert_chain(str(_readable(tls.cert, "cert")), str(_readable(tls.key, "key")))
        except ssl.SSLError as exc:
            raise config.ConfigError(
                f"nats_tls.cert / nats_tls.key: not a matching certificate and key ({exc.reason})"
            ) from None
    return ctx


def identity(tls: NatsTLS) -> str | None:
    """The identity (certificate common name) this client authenticates as, if any."""
    if not tls.cert:
        return None
    try:
        cert = x509.load_pem_x509_certificate(_readable(tls.cert, "cert").read_bytes())
    except ValueError as exc:
        raise config.ConfigError(f"nats_tls.cert = {tls.cert!r}: not a PEM certificate") from exc
    return common_name(cert)


def nats_options(tls: NatsTLS) -> dict[str, Any]:
    """Keyword arguments for `bus.connect` / `nats.connect`; empty when TLS is off."""
    if not tls.enabled:
        return {}
    opts: dict[str, Any] = {"tls": ssl_context(tls)}
    if tls.server_name:
        opts["tls_hostname"] = tls.server_name
    name = identity(tls)
    if name:
        opts["inbox_prefix"] = inbox_prefix(name)
    return opts
