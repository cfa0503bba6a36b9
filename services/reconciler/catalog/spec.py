"""The catalog file: what should run. Parse, validate, and diff against the log. Pure.

A catalog file is the WHOLE desired catalog:

    bands:   [{name, ceiling, queue_capacity, queue_ttl_seconds}]     # highest priority first
    models:  [{name, aliases, fallbacks, replicas | autoscale, profile, scheduling, deadlines,
              upstream, owned_by, api_kinds, migration,
              disaggregation: {prefill: {replicas, profile}, decode: {...},
                               connector: {kind, shared_path, extra}, min_prompt_tokens}}]
    tenants: [{name, band, key_hashes, quotas, cache_isolation}]
    adapters: [{name, base, source, tenants, pinned}]                  # LoRA adapters

Entries are the message contract's own types (ServingProfile, SchedulingSpec,
DeadlineSpec, Quotas, Band), so the file and the events cannot drift apart.
`plan()` compares it with the current catalog (folded from the log's catalog
subjects) and returns only the events that change something: models, tenants
and adapters declared when new or different, removed when gone, bands
re-declared when the list differs. Applying the same file twice yields no events.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import msgspec

from llmgw import config, subjects
from llmgw import contracts as c
from llmgw.engines import ENGINES

_KEY_HASH = re.compile(r"sha256:[0-9a-f]{64}")
_ENVELOPE = ("type", "v", "id", "ts")
# A stream that needs more continuations than this is failing for a reason another
# replica will not fix.
MAX_MIGRATIONS = 8


class CatalogModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    aliases: list[str] = msgspec.field(default_factory=list)
    fallbacks: list[str] = msgspec.field(default_factory=list)
    # None: 1, or autoscale.min with autoscale (the two are exclusive).
    replicas: int | None = None
    profile: c.ServingProfile = msgspec.field(default_factory=c.ServingProfile)
    scheduling: c.SchedulingSpec = msgspec.field(default_factory=c.SchedulingSpec)
    deadlines: c.DeadlineSpec = msgspec.field(default_factory=c.DeadlineSpec)
    upstream: c.UpstreamSpec = msgspec.field(default_factory=c.UpstreamSpec)
    owned_by: str = ""
    api_kinds: list[str] = msgspec.field(default_factory=list)
    autoscale: c.AutoscaleSpec | None = None
    migration: c.MigrationSpec = msgspec.field(default_factory=c.MigrationSpec)
    # Set: a prefill pool and a decode pool, each with its own count (then `replicas`
    # and `autoscale` stay unset).
    disaggregation: c.DisaggregationSpec | None = None

    def event(self) -> c.ModelDeclared:
        data = msgspec.to_builtins(self)
        if self.disaggregation is not None:
            data["replicas"] = 0  # no aggregated replica: the pools have the counts
            for role in c.PD_ROLES:
                pool = data["disaggregation"][role]
                if pool.get("autoscale") is not None:
                    pool["replicas"] = pool["autoscale"]["min"]  # where an autoscaled pool starts
        elif self.replicas is None:
            data["replicas"] = self.autoscale.min if self.autoscale is not None else 1
        return msgspec.convert(data, c.ModelDeclared)


class CatalogTenant(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    band: str
    key_hashes: list[str] = msgspec.field(default_factory=list)
    quotas: c.Quotas = msgspec.field(default_factory=c.Quotas)
    cache_isolation: str = "none"

    def event(self) -> c.TenantDeclared:
        return msgspec.convert(msgspec.to_builtins(self), c.TenantDeclared)


class CatalogAdapter(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A LoRA adapter of a base model: requests name it as their `model`."""

    name: str
    base: str
    source: str
    tenants: list[str] = msgspec.field(default_factory=list)
    pinned: int = 0

    def event(self) -> c.AdapterDeclared:
        return msgspec.convert(msgspec.to_builtins(self), c.AdapterDeclared)


class Catalog(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bands: list[c.Band] = msgspec.field(default_factory=list)
    models: list[CatalogModel] = msgspec.field(default_factory=list)
    tenants: list[CatalogTenant] = msgspec.field(default_factory=list)
    adapters: list[CatalogAdapter] = msgspec.field(default_factory=list)


class CatalogError(ValueError):
    """Every problem found in a catalog file, one per line, each naming entry and field."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


# ------------------------------------------------------------------ parsing


def _describe(value: Any) -> str:
    return repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


def _unknown_keys(data: Any, cls: type, path: str) -> list[str]:
    """Keys the struct (recursively) does not have: typos that would silently do nothing."""
    # An optional section (`X | None`) is checked as X.
    args = [a for a in typing.get_args(cls) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(cls) in (typing.Union, types.UnionType):
        cls = args[0]
    if not (isinstance(data, dict) and isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        return []
    fields = {f.encode_name: f.type for f in msgspec.structs.fields(cls)}
    out = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            known = ", ".join(sorted(fields))
            out.append(f"{where}: unknown field (known: {known})")
        else:
            out += _unknown_keys(value, fields[key], where)
    return out


_EXPECTED_RE = re.compile(r"^Expected `(?P<want>[^`]+)`, got `[^`]+`$")


def _convert_error(exc: msgspec.ValidationError, data: Any) -> str:
    reason, at = config.split_validation_error(exc)
    path = (at or "").lstrip(".")
    expected = _EXPECTED_RE.match(reason)
    if expected:
        want = expected.group("want").replace(" | null", " or null")
        reason = f"expected {want}, got {_describe(config.lookup(data, at or ''))}"
    else:
        reason = reason[0].lower() + reason[1:].replace("`", "")
    return f"{path}: {reason}" if path else reason


def _entries(data: dict[str, Any], section: str, cls: type, problems: list[str]) -> list[Any]:
    raw = data.get(section, [])
    if raw is None:
        return []
    if not isinstance(raw, list):
        problems.append(f"{section}: expected a list of entries, got {_describe(raw)}")
        return []
    out = []
    for i, entry in enumerate(raw):
        label = f"{section}[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{label}: expected a mapping, got {_describe(entry)}")
            continue
        if isinstance(entry.get("name"), str):
            label += f" (name={entry['name']})"
        unknown = _unknown_keys(entry, cls, "")
        if unknown:
            problems += [f"{label}: {u}" for u in unknown]
            continue
        try:
            out.append((label, msgspec.convert(entry, cls, strict=True)))
        except msgspec.ValidationError as exc:
            problems.append(f"{label}: {_convert_error(exc, entry)}")
    return out


def _raw_names(data: dict[str, Any], section: str) -> set[str]:
    entries = data.get(section)
    if not isinstance(entries, list):
        return set()
    return {e["name"] for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str)}


def parse(data: Any) -> Catalog:
    """A validated Catalog from parsed YAML, or CatalogError listing every problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CatalogError([f"the catalog must be a mapping, got {_describe(data)}"])
    problems = [
        f"{key}: unknown section (known: {', '.join(_SECTIONS)})"
        for key in data
        if key not in _SECTIONS
    ]
    bands = _entries(data, "bands", c.Band, problems)
    models = _entries(data, "models", CatalogModel, problems)
    tenants = _entries(data, "tenants", CatalogTenant, problems)
    adapters = _entries(data, "adapters", CatalogAdapter, problems)
    # Entries that failed to parse still exist for references: one error, not two.
    problems += _check(
        bands, models, tenants, _raw_names(data, "models"), _raw_names(data, "bands")
    )
    problems += _check_adapters(
        adapters, models, _raw_names(data, "models"), _raw_names(data, "tenants")
    )
    if problems:
        raise CatalogError(problems)
    return Catalog(
        bands=[b for _, b in bands],
        models=[m for _, m in models],
        tenants=[t for _, t in tenants],
        adapters=[a for _, a in adapters],
    )


_SECTIONS = ("bands", "models", "tenants", "adapters")


# ------------------------------------------------------------------ semantic checks


def _names(entries: list[tuple[str, Any]], what: str) -> list[str]:
    problems = []
    seen: dict[str, str] = {}
    tokens: dict[str, str] = {}
    for label, entry in entries:
        if not entry.name.strip():
            problems.append(f"{label}: name: must not be empty")
            continue
        if entry.name in seen:
            problems.append(f"{label}: name: duplicate {what} (also {seen[entry.name]})")
            continue
        seen[entry.name] = label
        # Names become subject tokens; two names that map to one token would share a subject.
        token = subjects.safe_token(entry.name)
        if token in tokens:
            problems.append(
                f"{label}: name: {entry.name!r} and {tokens[token]!r} map to the same "
                f"subject token {token!r}; rename one"
            )
        tokens.setdefault(token, entry.name)
    return problems


def _check_model(label: str, m: CatalogModel) -> list[str]:
    out = []
    if m.replicas is not None and m.replicas < 0:
        out.append(f"{label}: replicas: must be 0 or more, got {m.replicas}")
    if m.autoscale is not None:
        if m.replicas is not None:
            out.append(
                f"{label}: autoscale: exclusive with replicas (a fixed count); remove one of them"
            )
        out += _check_autoscale(label, m.autoscale)
    out += _check_profile(label, "profile", m.profile)
    if m.disaggregation is not None:
        out += _check_disaggregation(label, m, m.disaggregation)
    for name in ("connect", "headers", "first_token", "idle", "total"):
        if getattr(m.deadlines, name) <= 0:
            out.append(f"{label}: deadlines.{name}: must be positive seconds")
    for kind in m.api_kinds:
        if kind not in c.API_KINDS:
            out.append(
                f"{label}: api_kinds: unknown kind {kind!r} (known: {', '.join(c.API_KINDS)})"
            )
    if not 0 <= m.migration.max <= MAX_MIGRATIONS:
        out.append(
            f"{label}: migration.max: must be between 0 (off) and {MAX_MIGRATIONS}, "
            f"got {m.migration.max}"
        )
    out += _check_scheduling(label, m.scheduling)
    return out


def _check_profile(label: str, where: str, p: c.ServingProfile) -> list[str]:
    """A serving profile's own problems; `where` is its path (a pool's has its own)."""
    out = []
    if p.engine not in ENGINES:
        out.append(f"{label}: {where}.engine: {p.engine!r} is not one of {', '.join(ENGINES)}")
    if p.engine in ("vllm", "sglang") and not p.model_ref:
        out.append(f"{label}: {where}.model_ref: required for engine {p.engine}")
    if p.gpus_per_shard < 1:
        out.append(f"{label}: {where}.gpus_per_shard: must be at least 1, got {p.gpus_per_shard}")
    if p.shards_per_replica < 1:
        out.append(
            f"{label}: {where}.shards_per_replica: must be at least 1, got {p.shards_per_replica}"
        )
    if p.min_gpu_memory_bytes < 0:
        out.append(f"{label}: {where}.min_gpu_memory_bytes: must be 0 or more")
    if p.gpu_memory_utilization is not None and not 0 < p.gpu_memory_utilization <= 1:
        out.append(f"{label}: {where}.gpu_memory_utilization: must be in (0, 1]")
    for name in ("max_model_len", "max_num_seqs"):
        if (getattr(p, name) or 1) < 1:
            out.append(f"{label}: {where}.{name}: must be positive (omit it for the default)")
    if p.max_loras < 0:
        out.append(f"{label}: {where}.max_loras: must be 0 or more, got {p.max_loras}")
    if p.max_lora_rank < 1:
        out.append(f"{label}: {where}.max_lora_rank: must be at least 1, got {p.max_lora_rank}")
    return out


# The engines whose launch takes a KV connector (vLLM's --kv-transfer-config) and the
# simulator, which speaks the same protocol: the engines table's pd_connector, which the
# agent checks too. SGLang's disaggregation is another protocol (its own bootstrap
# server, mooncake/nixl transfer) that the routers do not speak.
PD_ENGINES = tuple(name for name, traits in ENGINES.items() if traits.pd_connector)


def _check_disaggregation(label: str, m: CatalogModel, d: c.DisaggregationSpec) -> list[str]:
    """A model served by a prefill pool and a decode pool (docs/catalog.md)."""
    out = []
    if m.replicas is not None or m.autoscale is not None:
        what = "replicas" if m.replicas is not None else "autoscale"
        out.append(
            f"{label}: {what}: exclusive with disaggregation (each pool has its own count); "
            f"set disaggregation.prefill.replicas and disaggregation.decode.replicas instead"
        )
    for role in c.PD_ROLES:
        pool: c.PoolSpec = getattr(d, role)
        where = f"disaggregation.{role}"
        if pool.autoscale is not None:
            if pool.replicas != c.PoolSpec().replicas:
                # A count other than the default: one the file set (`replicas: 1` cannot be
                # told from no replicas at all, and means the same as min 1).
                out.append(
                    f"{label}: {where}.replicas: exclusive with {where}.autoscale (the pool "
                    "starts at autoscale.min); remove one of them"
                )
            out += _check_autoscale(label, pool.autoscale, f"{where}.autoscale")
            if pool.autoscale.min < 1:
                out.append(
                    f"{label}: {where}.autoscale.min: must be at least 1, got "
                    f"{pool.autoscale.min} (a disaggregated model needs both pools)"
                )
        elif pool.replicas < 1:
            out.append(
                f"{label}: {where}.replicas: must be at least 1, got {pool.replicas} (a "
                "disaggregated model needs both pools; remove disaggregation to serve it "
                "aggregated)"
            )
        profile = pool.profile if pool.profile is not None else m.profile
        if pool.profile is not None:
            out += _check_profile(label, f"{where}.profile", pool.profile)
        shown = f"{where}.profile" if pool.profile is not None else "profile"
        if profile.engine in ENGINES and profile.engine not in PD_ENGINES:
            out.append(
                f"{label}: {shown}.engine: {profile.engine} cannot serve a disaggregated pool "
                f"(only {', '.join(PD_ENGINES)} take a KV connector); SGLang's own "
                "disaggregation is not supported"
            )
        if profile.max_loras > 0:
            out.append(
                f"{label}: {shown}.max_loras: LoRA adapters on a disaggregated model are not "
                "supported (the prefill and decode engines would both need the adapter); "
                "set it to 0"
            )
    conn = d.connector
    if not conn.kind.strip():
        out.append(f"{label}: disaggregation.connector.kind: must not be empty")
    elif conn.kind == "ExampleConnector" and not conn.shared_path.strip():
        out.append(
            f"{label}: disaggregation.connector.shared_path: required for ExampleConnector "
            "(the folder prefill engines write KV to and decode engines read it from, the "
            "same on every node)"
        )
    if d.min_prompt_tokens < 0:
        out.append(
            f"{label}: disaggregation.min_prompt_tokens: must be 0 or more, got "
            f"{d.min_prompt_tokens}"
        )
    return out


def _check_scheduling(label: str, s: c.SchedulingSpec) -> list[str]:
    """Plugin names the routers have: a router cannot build a pipeline from any other."""
    out = [
        f"{label}: scheduling.filters: unknown filter {name!r} (known: {', '.join(c.FILTER_NAMES)})"
        for name in s.filters
        if name not in c.FILTER_NAMES
    ]
    for name, weight in s.scorers.items():
        if name not in c.SCORER_NAMES:
            out.append(
                f"{label}: scheduling.scorers: unknown scorer {name!r} "
                f"(known: {', '.join(c.SCORER_NAMES)})"
            )
        elif not weight >= 0:
            out.append(f"{label}: scheduling.scorers.{name}: must be 0 or more, got {weight}")
    if s.picker not in c.PICKER_NAMES:
        out.append(
            f"{label}: scheduling.picker: unknown picker {s.picker!r} "
            f"(known: {', '.join(c.PICKER_NAMES)})"
        )
    return out


def _check_autoscale(label: str, a: c.AutoscaleSpec, where: str = "autoscale") -> list[str]:
    """`where`: the spec's path in the entry (a model's, or a pool's)."""
    out = []
    if a.min < 0:
        out.append(f"{label}: {where}.min: must be 0 or more, got {a.min}")
    if a.max < 1:
        out.append(f"{label}: {where}.max: must be at least 1, got {a.max}")
    elif a.max < a.min:
        out.append(f"{label}: {where}.max: must be at least {where}.min ({a.min}), got {a.max}")
    if a.signal not in c.AUTOSCALE_SIGNALS:
        out.append(
            f"{label}: {where}.signal: {a.signal!r} is not one of {', '.join(c.AUTOSCALE_SIGNALS)}"
        )
    if not a.target > 0:
        out.append(f"{label}: {where}.target: must be positive, got {a.target}")
    if not 0 <= a.tolerance < 1:
        out.append(f"{label}: {where}.tolerance: must be in [0, 1), got {a.tolerance}")
    for name in ("scale_up_after_seconds", "scale_down_after_seconds"):
        if getattr(a, name) < 0:
            out.append(f"{label}: {where}.{name}: must be 0 or more seconds")
    return out


def _fallback_cycles(models: list[tuple[str, CatalogModel]]) -> list[str]:
    graph = {m.name: [f for f in m.fallbacks if f != m.name] for _, m in models}
    labels = {m.name: label for label, m in models}
    problems = []
    reported: set[frozenset[str]] = set()
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, []):
                if nxt == start:
                    cycle = frozenset(path)
                    if cycle not in reported:
                        reported.add(cycle)
                        shown = " -> ".join([*path, start])
                        problems.append(f"{labels[start]}: fallbacks: cycle {shown}")
                elif nxt not in path and nxt in graph:
                    stack.append((nxt, [*path, nxt]))
    return problems


def _check(
    bands: list[tuple[str, c.Band]],
    models: list[tuple[str, CatalogModel]],
    tenants: list[tuple[str, CatalogTenant]],
    model_names: set[str],
    band_names: set[str],
) -> list[str]:
    problems = _names(bands, "band") + _names(models, "model") + _names(tenants, "tenant")
    for label, band in bands:
        if band.ceiling <= 0:
            problems.append(f"{label}: ceiling: must be positive, got {band.ceiling}")
        if band.queue_capacity < 0:
            problems.append(f"{label}: queue_capacity: must be 0 or more")
        if band.queue_ttl_seconds <= 0:
            problems.append(f"{label}: queue_ttl_seconds: must be positive")
    alias_owner: dict[str, str] = {}
    for label, m in models:
        problems += _check_model(label, m)
        for alias in m.aliases:
            if alias == m.name:
                problems.append(f"{label}: aliases: {alias!r} is the model's own name")
            elif alias in model_names:
                problems.append(f"{label}: aliases: {alias!r} shadows the model of that name")
            elif alias in alias_owner and alias_owner[alias] != m.name:
                problems.append(
                    f"{label}: aliases: {alias!r} is already an alias of {alias_owner[alias]!r}"
                )
            alias_owner.setdefault(alias, m.name)
        for fb in m.fallbacks:
            if fb == m.name:
                problems.append(f"{label}: fallbacks: a model cannot fall back to itself")
            elif fb not in model_names:
                problems.append(f"{label}: fallbacks: {fb!r} is not a model in this catalog")
    problems += _fallback_cycles(models)
    key_owner: dict[str, str] = {}
    for label, t in tenants:
        if t.band not in band_names:
            known = ", ".join(sorted(band_names)) or "none declared"
            problems.append(f"{label}: band: {t.band!r} is not a declared band ({known})")
        for i, h in enumerate(t.key_hashes):
            if not _KEY_HASH.fullmatch(h):
                problems.append(
                    f"{label}: key_hashes[{i}]: expected 'sha256:' and 64 lowercase hex digits "
                    "(make one with `llmgw keys hash`)"
                )
            elif h in key_owner and key_owner[h] != t.name:
                problems.append(
                    f"{label}: key_hashes[{i}]: the same key already belongs to tenant "
                    f"{key_owner[h]!r}"
                )
            key_owner.setdefault(h, t.name)
        for q in ("rpm", "tpm", "concurrency"):
            value = getattr(t.quotas, q)
            if value is not None and value <= 0:
                problems.append(f"{label}: quotas.{q}: must be positive (omit it for no limit)")
        if t.cache_isolation not in c.CACHE_ISOLATION:
            problems.append(
                f"{label}: cache_isolation: unknown value {t.cache_isolation!r} "
                f"(known: {', '.join(c.CACHE_ISOLATION)})"
            )
    return problems


def _check_adapters(
    adapters: list[tuple[str, CatalogAdapter]],
    models: list[tuple[str, CatalogModel]],
    model_names: set[str],
    tenant_names: set[str],
) -> list[str]:
    """An adapter's name is what requests put in `model`: it must name nothing else, and
    its base must be a model whose engines have adapter slots."""
    problems = _names(adapters, "adapter")
    parsed = {m.name: m for _, m in models}
    aliases = {alias: m.name for _, m in models for alias in m.aliases}
    for label, a in adapters:
        if a.name in model_names:
            problems.append(f"{label}: name: {a.name!r} is already a model's name")
        elif a.name in aliases:
            problems.append(f"{label}: name: {a.name!r} is already an alias of {aliases[a.name]!r}")
        if not a.source.strip():
            problems.append(f"{label}: source: must not be empty (the path its engines load)")
        if a.pinned < 0:
            problems.append(f"{label}: pinned: must be 0 or more, got {a.pinned}")
        for tenant in a.tenants:
            if tenant not in tenant_names:
                problems.append(f"{label}: tenants: {tenant!r} is not a tenant in this catalog")
        base = parsed.get(a.base)
        if a.base not in model_names:
            known = ", ".join(sorted(model_names)) or "none declared"
            problems.append(f"{label}: base: {a.base!r} is not a model in this catalog ({known})")
        elif base is None:
            continue  # the base failed to parse: its own error says why
        elif base.profile.max_loras < 1:
            problems.append(
                f"{label}: base: model {a.base!r} has no adapter slots (set its profile.max_loras)"
            )
        elif a.pinned > _most_replicas(base):
            problems.append(
                f"{label}: pinned: {a.pinned} replica(s), but model {a.base!r} has at most "
                f"{_most_replicas(base)}"
            )
    return problems


def _most_replicas(m: CatalogModel) -> int:
    if m.autoscale is not None:
        return m.autoscale.max
    return 1 if m.replicas is None else m.replicas


# ------------------------------------------------------------------ diff


@dataclass
class Current:
    """The catalog as the log has it: the last event per catalog subject, folded."""

    models: dict[str, c.ModelDeclared] = field(default_factory=dict)
    tenants: dict[str, c.TenantDeclared] = field(default_factory=dict)
    bands: list[c.Band] = field(default_factory=list)
    adapters: dict[str, c.AdapterDeclared] = field(default_factory=dict)
    # The stream sequence of the last message per subject, for optimistic concurrency.
    subject_seqs: dict[str, int] = field(default_factory=dict)

    def add(self, subject: str, seq: int, event: c.Message) -> None:
        self.subject_seqs[subject] = seq
        match event:
            case c.ModelDeclared():
                self.models[event.name] = event
            case c.ModelRemoved():
                self.models.pop(event.name, None)
            case c.TenantDeclared():
                self.tenants[event.name] = event
            case c.TenantRemoved():
                self.tenants.pop(event.name, None)
            case c.BandsDeclared():
                self.bands = list(event.bands)
            case c.AdapterDeclared():
                self.adapters[event.name] = event
            case c.AdapterRemoved():
                self.adapters.pop(event.name, None)


def _body(msg: c.Message) -> dict[str, Any]:
    """A message without its envelope: what comparing 'the same declaration' means."""
    out = msgspec.to_builtins(msg)
    for key in _ENVELOPE:
        out.pop(key, None)
    return out


def _changed_fields(old: c.Message, new: c.Message) -> list[str]:
    a, b = _body(old), _body(new)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


@dataclass
class Step:
    event: c.Message
    summary: str  # one line an operator reads, e.g. "model llama: changed (replicas)"


def _declarations(kind: str, entries: list, current: dict[str, c.Message]) -> list[Step]:
    """A declaration per entry that is new or differs from the current one."""
    steps = []
    for entry in entries:
        ev = entry.event()
        old = current.get(entry.name)
        if old is None:
            steps.append(Step(ev, f"{kind} {entry.name}: declared"))
        elif _body(old) != _body(ev):
            changed = ", ".join(_changed_fields(old, ev))
            steps.append(Step(ev, f"{kind} {entry.name}: changed ({changed})"))
    return steps


def plan(catalog: Catalog, current: Current) -> list[Step]:
    """The events that turn `current` into `catalog`, in an order routers can follow:
    bands first (tenants name them), declarations (adapters after the models they name),
    then removals (adapters before the models they name)."""
    steps: list[Step] = []
    if msgspec.to_builtins(catalog.bands) != msgspec.to_builtins(current.bands):
        names = ", ".join(b.name for b in catalog.bands) or "none"
        steps.append(Step(c.BandsDeclared(bands=list(catalog.bands)), f"bands: set to {names}"))
    steps += _declarations("model", catalog.models, current.models)
    steps += _declarations("tenant", catalog.tenants, current.tenants)
    steps += _declarations("adapter", catalog.adapters, current.adapters)
    wanted_adapters = {a.name for a in catalog.adapters}
    for name in sorted(set(current.adapters) - wanted_adapters):
        steps.append(Step(c.AdapterRemoved(name=name), f"adapter {name}: removed"))
    wanted_tenants = {t.name for t in catalog.tenants}
    for name in sorted(set(current.tenants) - wanted_tenants):
        steps.append(Step(c.TenantRemoved(name=name), f"tenant {name}: removed"))
    wanted_models = {m.name for m in catalog.models}
    for name in sorted(set(current.models) - wanted_models):
        steps.append(Step(c.ModelRemoved(name=name), f"model {name}: removed"))
    return steps
