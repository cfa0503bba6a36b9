"""`llmgw certs init`: a development CA and the certificates NATS mutual TLS needs.

One CA signs a server certificate (for the names and addresses clients dial)
and one client certificate per identity. The identity is the certificate's
subject, `CN=<name>,O=llmgw`, which the nats-server config written by
`llmgw nats-config` maps to that identity's permissions. The names are:

    agent-<node>   one per node: may publish only as that node
    router-<i>     one per router instance: may speak only as router id `router-<i>`
    reconciler     shared by the leader and its standbys
    operator       the CLI (`llmgw apply`, `llmgw events` ...)

A second server certificate, `reconciler-admin`, is for the reconcilers'
admin listener (the operator API with `admin_tls`): its own key, so a
reconciler never holds the NATS server's. Clients present their identity's
client certificate there too (the CLI `operator`'s).

Running `init` again reuses the CA and every certificate already in the
folder and adds the missing ones, so a new node is one more `--nodes n3` away
and does not invalidate certificates deployed elsewhere. `--force` replaces
the leaf certificates (never the CA: that would invalidate every one).

This is a development CA: its key sits next to the certificates. Production
deployments use their own PKI (cert-manager, Vault ...) with the same subjects.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import subjects

ORG = "llmgw"
CA_NAME = "ca"
SERVER_NAME = "server"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
# The service name NATS gets in docker-compose and in the Kubernetes manifests.
DEFAULT_EXTRA_HOSTS = ("nats", "nats.llmgw.svc", "nats.llmgw.svc.cluster.local")
ADMIN_SERVER_NAME = "reconciler-admin"
# The reconcilers' names in docker-compose and their Service in the Kubernetes manifests.
ADMIN_EXTRA_HOSTS = (
    "reconciler-1",
    "reconciler-2",
    "llmgw-reconciler",
    "llmgw-reconciler.llmgw.svc",
    "llmgw-reconciler.llmgw.svc.cluster.local",
)
SERVER_CERTS = (SERVER_NAME, ADMIN_SERVER_NAME)


class CertError(ValueError):
    pass


@dataclass(frozen=True)
class Identity:
    """A client identity: its name (the certificate's CN) and its role."""

    name: str
    role: str  # agent | router | reconciler | operator
    node: str | None = None  # agents only

    @property
    def router_id(self) -> str | None:
        """The router id a router identity speaks for: its own name, as `llmgw dev`
        names its routers; the bus lets it publish presence and demand only as that."""
        return self.name if self.role == "router" else None

    @property
    def subject(self) -> str:
        """The RFC 4514 subject string nats-server matches with verify_and_map."""
        return f"CN={self.name},O={ORG}"


def agent_identity(node: str) -> Identity:
    subjects.token(node, "node id")
    return Identity(f"agent-{node}", "agent", node)


def identity_from_name(name: str) -> Identity:
    """The role of a certificate, read back from its common name."""
    if name.startswith("agent-") and len(name) > len("agent-"):
        return agent_identity(name[len("agent-") :])
    if name == "router" or (name.startswith("router-") and len(name) > len("router-")):
        subjects.token(name, "router identity")
        return Identity(name, "router")
    if name in ("reconciler", "operator"):
        return Identity(name, name)
    raise CertError(
        f"certificate name {name!r} has no role: expected agent-<node>, router-<n>, "
        "reconciler or operator"
    )


def identities(nodes: Iterable[str], routers: int) -> list[Identity]:
    out = [agent_identity(n) for n in nodes]
    out += [Identity(f"router-{i}", "router") for i in range(1, routers + 1)]
    out += [Identity("reconciler", "reconciler"), Identity("operator", "operator")]
    return out


# ---------------------------------------------------------------- pure-ish crypto


def _name(common_name: str) -> x509.Name:
    # Most significant first, so the RFC 4514 form reads "CN=...,O=llmgw".
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: fast to make, accepted by Go's crypto/tls (nats-server) and OpenSSL alike.
    return ec.generate_private_key(ec.SECP256R1())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def make_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _new_key()
    name = _name("llmgw development CA")
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    days: int,
    *,
    server_hosts: Iterable[str] | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A server certificate when `server_hosts` is given, else a client certificate.

    Client certificates carry no subject alternative names on purpose:
    nats-server's verify_and_map tries SANs before the subject, and the
    subject is what the generated config maps.
    """
    key = _new_key()
    now = _now()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server_hosts else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if server_hosts:
        builder = builder.add_extension(_san(server_hosts), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


# ---------------------------------------------------------------- files


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _save(directory: Path, name: str, key, cert: x509.Certificate) -> None:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(directory / f"{name}.key", key_pem, 0o600)
    _write(directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _load(directory: Path, name: str):
    try:
        key = serialization.load_pem_private_key((directory / f"{name}.key").read_bytes(), None)
        cert = x509.load_pem_x509_certificate((directory / f"{name}.crt").read_bytes())
    except (OSError, ValueError) as exc:
        raise CertError(f"{directory / name}.crt/.key: cannot be read: {exc}") from None
    return key, cert


def common_name(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not attrs:
        raise CertError("certificate has no common name")
    return str(attrs[0].value)


def read_identities(directory: Path) -> list[Identity]:
    """Every client identity whose certificate lies in `directory`, sorted by name."""
    found = []
    for path in sorted(Path(directory).glob("*.crt")):
        if path.stem in (CA_NAME, *SERVER_CERTS):
            continue
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
        except ValueError as exc:
            raise CertError(f"{path}: not a PEM certificate: {exc}") from None
        cn = common_name(cert)
        if cn != path.stem:
            raise CertError(f"{path}: common name {cn!r} does not match the file name")
        found.append(identity_from_name(cn))
    return found


def init(
    directory: Path,
    nodes: Iterable[str] = (),
    routers: int = 1,
    *,
    hosts: Iterable[str] = (),
    admin_hosts: Iterable[str] = (),
    days: int = 365,
    ca_days: int = 3650,
    force: bool = False,
) -> list[str]:
    """Create what is missing in `directory`; return the file stems written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    wanted = identities(nodes, routers)  # validates node ids before anything is written
    written: list[str] = []
    if (directory / f"{CA_NAME}.crt").exists():
        ca_key, ca_cert = _load(directory, CA_NAME)
    else:
        ca_key, ca_cert = make_ca(ca_days)
        _save(directory, CA_NAME, ca_key, ca_cert)
        written.append(CA_NAME)
    servers = {
        SERVER_NAME: ("nats-server", [*DEFAULT_HOSTS, *DEFAULT_EXTRA_HOSTS, *hosts]),
        ADMIN_SERVER_NAME: (ADMIN_SERVER_NAME, [*DEFAULT_HOSTS, *ADMIN_EXTRA_HOSTS, *admin_hosts]),
    }
    for stem, (cn, names) in servers.items():
        if force or not (directory / f"{stem}.crt").exists():
            server_hosts = list(dict.fromkeys(names))
            key, cert = make_leaf(ca_key, ca_cert, cn, days, server_hosts=server_hosts)
            _save(directory, stem, key, cert)
            written.append(stem)
    for ident in wanted:
        if force or not (directory / f"{ident.name}.crt").exists():
            key, cert = make_leaf(ca_key, ca_cert, ident.name, days)
            _save(directory, ident.name, key, cert)
            written.append(ident.name)
    return written


# ---------------------------------------------------------------- CLI


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    p = sub.add_parser("init", help="create (or complete) a development CA and certificates")
    p.add_argument("--dir", required=True, type=Path, help="folder for the PEM files")
    p.add_argument(
        "--nodes", type=_csv, default=[], help="node ids, comma-separated: one agent-<node> each"
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router identities router-1..router-N, one per router instance (default 1)",
    )
    p.add_argument(
        "--hosts",
        type=_csv,
        default=[],
        help="extra DNS names or IPs for the NATS server certificate "
        f"(always: {', '.join(DEFAULT_HOSTS + DEFAULT_EXTRA_HOSTS)})",
    )
    p.add_argument(
        "--admin-hosts",
        type=_csv,
        default=[],
        help=f"extra DNS names or IPs for the reconcilers' admin listener ({ADMIN_SERVER_NAME}) "
        f"(always: {', '.join(DEFAULT_HOSTS + ADMIN_EXTRA_HOSTS)})",
    )
    p.add_argument("--days", type=int, default=365, help="validity of leaf certificates")
    p.add_argument("--force", action="store_true", help="replace existing leaf certificates")


def run(args: argparse.Namespace) -> int:
    if args.routers < 0 or args.days <= 0:
        print("llmgw certs: --routers must be >= 0 and --days > 0", file=sys.stderr)
        return 2
    try:
        written = init(
            args.dir,
            args.nodes,
            args.routers,
            hosts=args.hosts,
            admin_hosts=args.admin_hosts,
            days=args.days,
            force=args.force,
        )
    except (CertError, subjects.SubjectError) as exc:
        print(f"llmgw certs: {exc}", file=sys.stderr)
        return 1
    present = [CA_NAME, *SERVER_CERTS] + [i.name for i in read_identities(args.dir)]
    for name in present:
        state = "created" if name in written else "kept"
        print(f"{state:8} {args.dir / name}.crt")
    return 0
