"""TLS settings as config sections: a service's NATS connection, and an admin listener's HTTPS.

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

`AdminTLS` is the server side, for the reconciler's admin listener (the
operator API): `admin_tls: {cert, key, ca}` makes it serve HTTPS and ask
every client for a certificate signed by `ca`. `admin_server_options` checks
the files and returns uvicorn's keyword arguments for it.
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


def _readable(path: str, key: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise config.ConfigError(f"{key} = {path!r}: no such file")
    return p


def _load_pair(ctx: ssl.SSLContext, cert: str, key: str, section: str) -> None:
    try:
        ctx.load_cert_chain(
            str(_readable(cert, f"{section}.cert")), str(_readable(key, f"{section}.key"))
        )
    except ssl.SSLError as exc:
        raise config.ConfigError(
            f"{section}.cert / {section}.key: not a matching certificate and key ({exc.reason})"
        ) from None


def client_context(ca: str, cert: str, key: str, section: str) -> ssl.SSLContext:
    """A client context that verifies the server against `ca` (the system's CAs when
    empty) and presents `cert`/`key`; errors name `section`'s keys."""
    if bool(cert) != bool(key):
        raise config.ConfigError(f"{section}: cert and key must be given together")
    cafile = str(_readable(ca, f"{section}.ca")) if ca else None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        _load_pair(ctx, cert, key, section)
    return ctx


def ssl_context(tls: NatsTLS) -> ssl.SSLContext:
    """A client context that verifies the server against `ca` and presents `cert`/`key`."""
    if not tls.ca:
        raise config.ConfigError("nats_tls.ca: required when nats_tls.cert is set")
    return client_context(tls.ca, tls.cert, tls.key, "nats_tls")


def identity(tls: NatsTLS) -> str | None:
    """The identity (certificate common name) this client authenticates as, if any."""
    if not tls.cert:
        return None
    try:
        cert = x509.load_pem_x509_certificate(_readable(tls.cert, "nats_tls.cert").read_bytes())
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


class AdminTLS(config.ConfigStruct, kw_only=True):
    """An admin listener's HTTPS with client certificates (mutual TLS); empty: plain HTTP."""

    cert: str = ""  # the listener's server certificate (PEM, chain after the leaf)
    key: str = ""  # its private key
    ca: str = ""  # CA bundle every client certificate must chain to

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)


def admin_server_options(tls: AdminTLS) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for `tls`; empty when it is off.

    There is no server-only TLS: a listener that takes a certificate also requires
    one from every client, so `ca` is mandatory. The files are loaded here the way
    uvicorn loads them, so a bad one stops the service at start with its key named
    rather than inside uvicorn's task."""
    section = "admin_tls"
    if not tls.enabled:
        return {}
    if not tls.cert and not tls.key:
        raise config.ConfigError(
            f"{section}.cert, {section}.key: required with {section}.ca (the listener's own "
            "certificate)"
        )
    if not tls.cert or not tls.key:
        raise config.ConfigError(f"{section}: cert and key must be given together")
    if not tls.ca:
        raise config.ConfigError(
            f"{section}.ca: required with {section}.cert (the listener asks every client "
            "for a certificate signed by it)"
        )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_pair(ctx, tls.cert, tls.key, section)
    try:
        ctx.load_verify_locations(str(_readable(tls.ca, f"{section}.ca")))
    except ssl.SSLError as exc:
        raise config.ConfigError(
            f"{section}.ca = {tls.ca!r}: not a PEM CA bundle ({exc.reason})"
        ) from None
    return {
        "ssl_certfile": tls.cert,
        "ssl_keyfile": tls.key,
        "ssl_ca_certs": tls.ca,
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
