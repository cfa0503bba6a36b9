"""From KV entries to the router's view and admission: decoding, checking, keeping.

Pure and synchronous: kvwatch.py delivers entries, these classes decode them
with `projection.decode` (which also checks that a record sits under its own
key) and feed the endpoint view (`replace`/`apply`/`remove`)
or the admission gate (`set_bands`, `set_tenants`). A record that does not
decode or does not make sense is logged and skipped, and the key keeps the
last good record it had: one bad write never takes a model or a tenant away.

A re-snapshot (after a reconnect) that finds a bucket empty while this router
holds records keeps them: a NATS server that lost its store comes back with
empty buckets until the reconciler writes them again, and clearing the view
(or worse, the tenants, which would open the router to requests without keys)
in that window would turn a control-plane hiccup into an outage. Records that
arrive afterwards apply one by one; a DEL still removes.

Every record carries the term of the reconciler leader that wrote it (and a
model's record the log position it reflects). A record older than the one
held for its key (a lower term, or the same term and a lower based_on_seq) is
a deposed leader's late write: it is skipped, and the key keeps the newer one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from llmgw import contracts as c
from llmgw import projection
from llmgw.router.admission.config import AdmissionSettings, tenant_problems
from llmgw.router.admission.config import check as admission_check
from llmgw.router.controlplane.watch import Entry
from llmgw.router.endpoints.view import EndpointView

log = logging.getLogger(__name__)


def _decode(bucket: str, entry: Entry) -> projection.Record | None:
    try:
        return projection.decode(bucket, entry.key, entry.value)
    except projection.Misplaced as exc:
        log.error("skipped the record under %r in %s: %s", entry.key, bucket, exc)
    except c.ContractError as exc:
        log.error("skipped a malformed record in %s under %r: %s", bucket, entry.key, exc)
    return None


def _stale(kind: str, key: str, new: tuple[int, ...], held: tuple[int, ...] | None) -> bool:
    if held is None or new >= held:
        return False
    log.warning(
        "skipped the %s record under %r: written by leader term/seq %s, older than %s held",
        kind,
        key,
        new,
        held,
    )
    return True


def _age(rec: c.ModelEndpoints) -> tuple[int, int]:
    return (rec.term, rec.based_on_seq)


class EndpointFeed:
    """The endpoints bucket: one ModelEndpoints per model."""

    def __init__(self, view: EndpointView):
        self.view = view
        self.records: dict[str, c.ModelEndpoints] = {}  # KV key -> last good record
        self.loaded = False  # a first snapshot was applied

    def _good(self, entry: Entry) -> c.ModelEndpoints | None:
        rec = _decode(projection.ENDPOINTS_BUCKET, entry)
        if not isinstance(rec, c.ModelEndpoints):
            return None
        held = self.records.get(entry.key)
        if _stale("endpoints", entry.key, _age(rec), held and _age(held)):
            return None
        return rec

    def snapshot(self, entries: dict[str, Entry]) -> None:
        if not entries and self.records:
            log.warning(
                "the endpoints bucket is empty after a restart of the watch: keeping the "
                "last view of %d models until the control plane writes again",
                len(self.records),
            )
            return
        records: dict[str, c.ModelEndpoints] = {}
        for key, entry in entries.items():
            rec = self._good(entry)
            if rec is None:
                rec = self.records.get(key)
            if rec is not None:
                records[key] = rec
        self.records = records
        self.view.replace(records.values())
        self.loaded = True

    def put(self, entry: Entry) -> None:
        rec = self._good(entry)
        if rec is None:
            return
        self.records[entry.key] = rec
        self.view.apply(rec)

    def delete(self, key: str) -> None:
        rec = self.records.pop(key, None)
        if rec is not None:
            self.view.remove(rec.model)


def _holds_bands(key: str) -> bool:
    return projection.kind_of(projection.TENANTS_BUCKET, key) == projection.BANDS_KIND


class TenantGate(Protocol):
    def set_bands(self, bands: list[c.Band]) -> None: ...

    def set_tenants(self, tenants: list[c.TenantRecord]) -> None: ...


class TenantFeed:
    """The tenants bucket: a TenantRecord per tenant, and one BandsRecord."""

    def __init__(self, gate: TenantGate, on_change: Callable[[], None] = lambda: None):
        self.gate = gate
        self.on_change = on_change  # after each change (the router re-checks its gate)
        self.tenants: dict[str, c.TenantRecord] = {}  # KV key -> last good record
        self.bands: list[c.Band] = []
        self.bands_term = 0  # the leader term of the bands record held
        self.loaded = False

    def _tenant(self, entry: Entry) -> c.TenantRecord | None:
        rec = _decode(projection.TENANTS_BUCKET, entry)
        if not isinstance(rec, c.TenantRecord):
            return None
        problems = tenant_problems(f"tenant {rec.name!r}", rec)
        if problems:
            log.error("skipped tenant record %r: %s", entry.key, "; ".join(problems))
            return None
        held = self.tenants.get(entry.key)
        if _stale("tenant", entry.key, (rec.term,), held and (held.term,)):
            return None
        return rec

    def _bands(self, entry: Entry) -> list[c.Band] | None:
        rec = _decode(projection.TENANTS_BUCKET, entry)
        if not isinstance(rec, c.BandsRecord):
            return None
        problems = admission_check(AdmissionSettings(), rec.bands, [])
        if problems:
            log.error("skipped the bands record: %s", "; ".join(problems))
            return None
        if _stale("bands", entry.key, (rec.term,), (self.bands_term,)):
            return None
        self.bands_term = rec.term
        return list(rec.bands)

    def snapshot(self, entries: dict[str, Entry]) -> None:
        if not entries and (self.tenants or self.bands):
            log.warning(
                "the tenants bucket is empty after a restart of the watch: keeping the last "
                "%d tenants and %d bands until the control plane writes again",
                len(self.tenants),
                len(self.bands),
            )
            return
        tenants: dict[str, c.TenantRecord] = {}
        bands = None
        for key, entry in entries.items():
            if _holds_bands(key):
                bands = self._bands(entry)
                if bands is None:
                    bands = self.bands
            else:
                rec = self._tenant(entry) or self.tenants.get(key)
                if rec is not None:
                    tenants[key] = rec
        self.tenants = tenants
        self.bands = bands or []
        self.loaded = True
        self._push()

    def put(self, entry: Entry) -> None:
        if _holds_bands(entry.key):
            bands = self._bands(entry)
            if bands is None:
                return
            self.bands = bands
        else:
            rec = self._tenant(entry)
            if rec is None:
                return
            self.tenants[entry.key] = rec
        self._push()

    def delete(self, key: str) -> None:
        if _holds_bands(key):
            self.bands = []
            self.bands_term = 0
        elif self.tenants.pop(key, None) is None:
            return
        self._push()

    def _push(self) -> None:
        # Bands first: tenants are indexed by them.
        self.gate.set_bands(self.bands)
        self.gate.set_tenants(sorted(self.tenants.values(), key=lambda t: t.name))
        log.info(
            "tenants from the control plane: %d; bands: %s",
            len(self.tenants),
            [b.name for b in self.bands] or "(default)",
        )
        self.on_change()
