"""Tenants and API-key authentication.

Keys are never stored: a presented key is hashed (SHA-256, about a microsecond)
and looked up by its hash, then the stored hash is compared with
hmac.compare_digest so the comparison itself leaks no timing. Keys and hashes
are never logged or echoed back.

A tenant is also the request path's `Caller` (seam.py): the owner of the stored
responses it creates and, with `cache_isolation`, the scope of its cache salt.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Protocol

from llmgw import contracts, keys

from .errors import AdmissionRejected
from .quotas import TenantQuotas

ANONYMOUS = "anonymous"


class Tenant:
    __slots__ = ("name", "band", "declared", "quotas", "key_hashes", "owner", "cache_isolation")

    def __init__(
        self,
        name: str,
        band: int,
        declared: contracts.Quotas,
        quotas: TenantQuotas,
        key_hashes: Sequence[str],
        cache_isolation: str = "none",
        owner: str | None = None,
    ):
        self.name = name
        self.band = band  # index into the band list, 0 = highest priority
        self.declared = declared  # global limits, before dividing among routers
        self.quotas = quotas
        self.key_hashes = tuple(key_hashes)
        self.cache_isolation = cache_isolation  # contracts.CACHE_ISOLATION
        self.owner = owner  # its name when declared; None for the tenant of no tenants

    def cache_scope(self, headers: dict[bytes, bytes]) -> bytes | None:
        """What its requests' cache salt is derived from: its name, and with `key`
        isolation also the hash of the key presented; None when its cache is shared."""
        isolation = self.cache_isolation
        if isolation == "none":
            return None
        scope = self.name.encode()
        if isolation == "key":
            auth = headers.get(b"authorization")
            digest = None if auth is None else key_digest(auth.decode("latin-1"))
            scope += b"\0" + (digest or "").encode()
        return scope

    def __repr__(self) -> str:  # never show key hashes
        return f"Tenant({self.name!r}, band={self.band})"


class TenantSpec(Protocol):
    """What a tenant is declared as: config entry or control-plane TenantRecord alike."""

    name: str
    band: str
    key_hashes: list[str]
    quotas: contracts.Quotas
    cache_isolation: str


def key_digest(authorization: str) -> str | None:
    """The stored form of the key in an Authorization header value (`Bearer <key>`),
    or None when it holds none."""
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return keys.HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


class Directory:
    """API key -> tenant. Rebuilt whole on reconfiguration; quota usage carries over by name."""

    def __init__(
        self,
        specs: Sequence[TenantSpec],
        band_index: dict[str, int],
        *,
        anonymous: str = "",
        routers: int = 1,
        previous: Directory | None = None,
    ) -> None:
        old = previous.by_name if previous else {}
        self.by_name: dict[str, Tenant] = {}
        self._by_hash: dict[str, Tenant] = {}
        lowest = len(band_index) - 1
        # Tenants whose band is not (or no longer) declared: they serve in the lowest band
        # rather than lose their keys; a config file never gets here (validation), the
        # control plane's records may for a moment while bands and tenants change.
        self.unknown_band: list[str] = []
        for spec in specs:
            quotas = old[spec.name].quotas if spec.name in old else None
            if quotas is None:
                quotas = TenantQuotas(spec.quotas, routers)
            else:
                quotas.set_limits(spec.quotas, routers)
            band = band_index.get(spec.band)
            if band is None:
                band = lowest
                self.unknown_band.append(spec.name)
            tenant = Tenant(
                spec.name,
                band,
                spec.quotas,
                quotas,
                spec.key_hashes,
                spec.cache_isolation,
                owner=spec.name,
            )
            self.by_name[spec.name] = tenant
            for digest in spec.key_hashes:
                self._by_hash[digest] = tenant
        # No tenants at all: every request is one anonymous tenant in the lowest band.
        self.open = not specs
        if self.open:
            prior = old.get(ANONYMOUS)
            unlimited = contracts.Quotas()
            quotas = prior.quotas if prior else TenantQuotas(unlimited, routers)
            self.by_name[ANONYMOUS] = Tenant(ANONYMOUS, lowest, unlimited, quotas, ())
            anonymous = ANONYMOUS
        # A configured anonymous tenant the control plane does not declare (yet): no
        # anonymous access until it does.
        self.anonymous = self.by_name.get(anonymous) if anonymous else None

    def set_routers(self, routers: int) -> None:
        for tenant in self.by_name.values():
            tenant.quotas.set_limits(tenant.declared, routers)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant for an Authorization header value, or a 401 AdmissionRejected."""
        if self.open:
            return self.anonymous  # type: ignore[return-value]
        if not authorization:
            if self.anonymous is not None:
                return self.anonymous
            raise AdmissionRejected(
                "missing_api_key",
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            )
        digest = key_digest(authorization)
        if digest is None:
            raise AdmissionRejected(
                "invalid_api_key",
                "The Authorization header must be 'Bearer <key>'.",
            )
        tenant = self._by_hash.get(digest)
        if tenant is None or not any(hmac.compare_digest(h, digest) for h in tenant.key_hashes):
            raise AdmissionRejected("invalid_api_key", "Incorrect API key provided.")
        return tenant
