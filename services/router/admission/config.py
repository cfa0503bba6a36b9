"""Admission config: the `admission`, `bands` and `tenants` keys of the router config.

Bands and tenants reuse the contract's shapes (contracts.Band, contracts.Quotas),
so the control plane's TenantRecord / BandsRecord feed the same objects later;
the subclasses here only add the config rule that unknown keys are errors.
"""

from __future__ import annotations

import math

import msgspec

from llmgw import config, contracts, keys


class AdmissionSettings(config.ConfigStruct, kw_only=True):
    # Off: no saturation gating and no queues. Keys and quotas still apply when tenants
    # are configured: switching flow control off must not open the door.
    enabled: bool = True
    # Waiting requests per endpoint that count as saturation 1.0 (the healthy limit).
    queue_threshold: float = 5.0
    # KV cache occupancy (0-1) that counts as saturation 1.0.
    kv_threshold: float = 0.8
    # Batch capacity assumed for an endpoint before a running count is seen (no max_running).
    assumed_capacity: int = 1
    # A learned capacity falls after requests waited at an engine this long while it ran
    # fewer than learned (a smaller engine behind the same id); 0: it never falls.
    capacity_relearn_seconds: float = 5.0
    # Tenant that serves requests carrying no Authorization header (development only).
    anonymous_tenant: str = ""
    # Completion allowance counted against tpm when a request sets no max_tokens.
    default_max_tokens: int = 256
    # Routers sharing the global quotas (router-only mode; the presence bucket overrides it).
    routers: int = 1
    # How often queues are re-checked while anything waits (stale metrics, TTLs).
    tick_seconds: float = 0.1


class QuotasConfig(contracts.Quotas, kw_only=True, forbid_unknown_fields=True):
    pass


class BandConfig(contracts.Band, kw_only=True, forbid_unknown_fields=True):
    pass


class TenantConfig(config.ConfigStruct, kw_only=True):
    name: str
    band: str
    key_hashes: list[str] = msgspec.field(default_factory=list)
    quotas: QuotasConfig = msgspec.field(default_factory=QuotasConfig)
    # Whose prefix cache its requests may share: none (everyone's), tenant, key.
    cache_isolation: str = "none"


# With no bands configured there is nothing to prioritise: one band that is never held
# back keeps a minimal router config behaving like a plain proxy.
DEFAULT_BANDS: tuple[contracts.Band, ...] = (contracts.Band(name="default", ceiling=2.0),)


def check(
    settings: AdmissionSettings,
    bands: list[contracts.Band],
    tenants: list[TenantConfig] | list[contracts.TenantRecord],
) -> list[str]:
    """Every problem that would misbehave at request time, each naming the entry."""
    problems: list[str] = []
    s = settings
    for key, value, ok in (
        ("queue_threshold", s.queue_threshold, s.queue_threshold > 0),
        ("kv_threshold", s.kv_threshold, 0 < s.kv_threshold <= 1),
        ("assumed_capacity", s.assumed_capacity, s.assumed_capacity >= 0),
        (
            "capacity_relearn_seconds",
            s.capacity_relearn_seconds,
            0 <= s.capacity_relearn_seconds < math.inf,
        ),
        ("default_max_tokens", s.default_max_tokens, s.default_max_tokens > 0),
        ("routers", s.routers, s.routers >= 1),
        ("tick_seconds", s.tick_seconds, s.tick_seconds > 0),
    ):
        if not ok:
            problems.append(f"admission.{key} = {value!r}: out of range")

    seen_bands: dict[str, int] = {}
    for i, band in enumerate(bands):
        where = f"bands[{i}] ({band.name!r})"
        if not band.name:
            problems.append(f"bands[{i}]: name is empty")
        elif band.name in seen_bands:
            problems.append(f"{where}: duplicate band name, also bands[{seen_bands[band.name]}]")
        seen_bands.setdefault(band.name, i)
        if not (band.ceiling > 0 and math.isfinite(band.ceiling)):
            problems.append(f"{where}: ceiling = {band.ceiling!r} must be a positive number")
        if band.queue_capacity < 0:
            problems.append(f"{where}: queue_capacity = {band.queue_capacity} is negative")
        if not band.queue_ttl_seconds > 0:
            problems.append(f"{where}: queue_ttl_seconds = {band.queue_ttl_seconds} must be > 0")
        if i and band.ceiling > bands[i - 1].ceiling:
            # A lower band with a higher ceiling would flow while a higher one is held:
            # the cluster must degrade from the bottom up.
            problems.append(
                f"{where}: ceiling {band.ceiling} is above that of the higher-priority band "
                f"{bands[i - 1].name!r} ({bands[i - 1].ceiling}); list bands highest first "
                "with ceilings that do not increase"
            )

    band_names = set(seen_bands) if bands else {b.name for b in DEFAULT_BANDS}
    seen_tenants: dict[str, int] = {}
    owner_of_hash: dict[str, str] = {}
    for i, tenant in enumerate(tenants):
        where = f"tenants[{i}] ({tenant.name!r})"
        if not tenant.name:
            problems.append(f"tenants[{i}]: name is empty")
        elif tenant.name in seen_tenants:
            problems.append(f"{where}: duplicate tenant, also tenants[{seen_tenants[tenant.name]}]")
        seen_tenants.setdefault(tenant.name, i)
        if tenant.band not in band_names:
            problems.append(
                f"{where}: band {tenant.band!r} is not configured (bands: {sorted(band_names)})"
            )
        problems += tenant_problems(where, tenant)
        for j, digest in enumerate(tenant.key_hashes):
            if (
                keys.is_key_hash(digest)
                and owner_of_hash.setdefault(digest, tenant.name) != tenant.name
            ):
                problems.append(
                    f"{where}: key_hashes[{j}] also belongs to tenant {owner_of_hash[digest]!r}"
                )

    if s.anonymous_tenant and s.anonymous_tenant not in seen_tenants:
        problems.append(
            f"admission.anonymous_tenant = {s.anonymous_tenant!r}: no tenant has that name"
        )
    return problems


def tenant_problems(where: str, tenant: TenantConfig | contracts.TenantRecord) -> list[str]:
    """What is wrong with one tenant on its own (its key hashes, quotas and cache
    isolation)."""
    problems = []
    if tenant.cache_isolation not in contracts.CACHE_ISOLATION:
        problems.append(
            f"{where}: cache_isolation = {tenant.cache_isolation!r} must be one of "
            f"{', '.join(contracts.CACHE_ISOLATION)}"
        )
    for j, digest in enumerate(tenant.key_hashes):
        if not keys.is_key_hash(digest):
            # Never echo the value: a pasted key instead of its hash is a secret.
            problems.append(
                f"{where}: key_hashes[{j}] is not 'sha256:<64 lowercase hex>' "
                "(use `llmgw keys hash KEY`)"
            )
    for field in ("rpm", "tpm", "concurrency"):
        value = getattr(tenant.quotas, field)
        if value is not None and value < 1:
            problems.append(f"{where}: quotas.{field} = {value} must be >= 1 (or unset)")
    return problems


def validate(
    settings: AdmissionSettings,
    bands: list[contracts.Band],
    tenants: list[TenantConfig] | list[contracts.TenantRecord],
) -> None:
    """Raise ConfigError listing every problem `check` finds."""
    problems = check(settings, bands, tenants)
    if problems:
        raise config.ConfigError("; ".join(problems))
