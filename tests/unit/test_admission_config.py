"""The admission keys of the router config: shape, defaults and validation messages."""

import msgspec
import pytest

from llmgw import config, keys
from llmgw.router.admission import AdmissionSettings, BandConfig, TenantConfig, validate
from llmgw.router.admission.config import DEFAULT_BANDS

H = keys.hash_key("sk-acme")


class Section(config.ConfigStruct, kw_only=True):
    """The three keys as the router config embeds them."""

    admission: AdmissionSettings = msgspec.field(default_factory=AdmissionSettings)
    bands: list[BandConfig] = msgspec.field(default_factory=list)
    tenants: list[TenantConfig] = msgspec.field(default_factory=list)


def load(tmp_path, text: str) -> Section:
    path = tmp_path / "router.yaml"
    path.write_text(text)
    section = config.load(Section, path, env={})
    validate(section.admission, section.bands, section.tenants)
    return section


def test_the_documented_shape_loads(tmp_path):
    s = load(
        tmp_path,
        f"""
admission: {{enabled: true}}
bands:
  - {{name: platinum, ceiling: 1.5, queue_capacity: 1000, queue_ttl_seconds: 30}}
  - {{name: bronze, ceiling: 0.8}}
tenants:
  - name: acme
    band: platinum
    key_hashes: ["{H}"]
    quotas: {{rpm: 600, tpm: 200000, concurrency: 64}}
""",
    )
    assert s.admission.enabled
    assert [b.name for b in s.bands] == ["platinum", "bronze"]
    assert s.bands[1].queue_capacity == 1000 and s.bands[1].queue_ttl_seconds == 30.0
    assert s.tenants[0].quotas.rpm == 600 and s.tenants[0].key_hashes == [H]


def test_defaults_leave_a_band_that_is_never_held_back(tmp_path):
    s = load(tmp_path, "{}")
    assert s.admission.enabled and not s.bands and not s.tenants
    assert DEFAULT_BANDS[0].ceiling > 1


@pytest.mark.parametrize(
    "text, needle",
    [
        ("bands: [{name: a, ceil: 1}]", "ceil"),
        ("tenants: [{name: t, band: a, quotas: {rmp: 3}}]", "rmp"),
        ("admission: {enabled: maybe}", "admission.enabled"),
    ],
)
def test_typos_are_errors_naming_the_key(tmp_path, text, needle):
    with pytest.raises(config.ConfigError, match=needle):
        load(tmp_path, text)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("bands: [{name: a}, {name: a}]", "bands[1] ('a'): duplicate band name"),
        ("bands: [{name: a, ceiling: 0}]", "ceiling = 0"),
        ("bands: [{name: a, ceiling: 0.5}, {name: b, ceiling: 0.9}]", "above that of"),
        ("bands: [{name: a, queue_ttl_seconds: 0}]", "queue_ttl_seconds"),
        ("tenants: [{name: t, band: gold}]", "band 'gold' is not configured"),
        ("tenants: [{name: t, band: default}, {name: t, band: default}]", "duplicate tenant"),
        ("tenants: [{name: t, band: default, key_hashes: [sk-oops]}]", "key_hashes[0]"),
        (
            f"tenants: [{{name: a, band: default, key_hashes: ['{H}']}},"
            f" {{name: b, band: default, key_hashes: ['{H}']}}]",
            "also belongs to tenant 'a'",
        ),
        ("tenants: [{name: t, band: default, quotas: {rpm: 0}}]", "quotas.rpm = 0"),
        (
            "tenants: [{name: t, band: default, cache_isolation: user}]",
            "tenants[0] ('t'): cache_isolation = 'user' must be one of none, tenant, key",
        ),
        ("admission: {anonymous_tenant: dev}", "anonymous_tenant = 'dev'"),
        ("admission: {kv_threshold: 1.5}", "admission.kv_threshold"),
        ("admission: {capacity_relearn_seconds: -1}", "admission.capacity_relearn_seconds"),
    ],
)
def test_validation_names_the_entry(tmp_path, text, needle):
    with pytest.raises(config.ConfigError) as err:
        load(tmp_path, text)
    assert needle in str(err.value)


def test_a_pasted_key_is_never_echoed(tmp_path):
    with pytest.raises(config.ConfigError) as err:
        load(tmp_path, "tenants: [{name: t, band: default, key_hashes: [sk-secret-value]}]")
    assert "sk-secret-value" not in str(err.value)
