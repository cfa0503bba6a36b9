"""State <-> table rows, and the rows each event adds to the logs. Pure: no I/O.

Every change kind `fold.apply()` reports maps to one table here. A row is the
view's fields as builtins, so writing a change is "serialise the current entry,
or delete it if it is gone", and loading is the exact inverse. The audit
compares `all_rows(replayed state)` with what the tables hold.

Adding state to `ClusterState` means adding its kind here and a migration; a
change kind without a projection raises, so the gap shows up in the first test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Table

from llmgw import contracts as c
from llmgw.reconciler.state import changes as ch
from llmgw.reconciler.state.changes import Change, ChangeKey
from llmgw.reconciler.state.model import (
    AdapterHoldings,
    ClusterState,
    NodeView,
    ReplicaView,
    ShardView,
)
from llmgw.reconciler.store import tables as t

Row = dict[str, Any]


def _message_row(msg: c.Message) -> Row:
    row = msgspec.to_builtins(msg)
    del row["type"], row["v"]
    row["event_id"] = row.pop("id")
    row["event_ts"] = row.pop("ts")
    return row


def _message_from_row(row: Row, cls: type[c.Message]) -> Any:
    data = dict(row)
    data["id"] = data.pop("event_id")
    data["ts"] = data.pop("event_ts")
    return msgspec.convert(data, cls)


@dataclass(frozen=True)
class Projection:
    """One state dict <-> one table, keyed by the table's primary key."""

    kind: str
    table: Table
    key: str
    attr: str  # the ClusterState dict it projects
    to_row: Callable[[ChangeKey, Any], Row]
    load: Callable[[ClusterState, Row], None]
    # The primary key's columns of a state key, for a delete: {key: state key} unless
    # the table's key has more than one column (model_scaling: model and role).
    key_columns: Callable[[ChangeKey], Row] | None = None

    def primary_key(self, key: ChangeKey) -> Row:
        return self.key_columns(key) if self.key_columns is not None else {self.key: key}

    def entries(self, state: ClusterState) -> dict[Any, Any]:
        return getattr(state, self.attr)


def _view_row(key: ChangeKey, view: msgspec.Struct) -> Row:
    return msgspec.to_builtins(view)


def _load_view(attr: str, cls: type, key: str) -> Callable[[ClusterState, Row], None]:
    def load(state: ClusterState, row: Row) -> None:
        getattr(state, attr)[row[key]] = msgspec.convert(row, cls)

    return load


def _load_message(attr: str, cls: type[c.Message], key: str):
    def load(state: ClusterState, row: Row) -> None:
        getattr(state, attr)[row[key]] = _message_from_row(row, cls)

    return load


def _load_scaling(state: ClusterState, row: Row) -> None:
    ev = _message_from_row(row, c.ModelScaled)
    state.scaled[ev.model, ev.role] = ev


PROJECTIONS: dict[str, Projection] = {
    p.kind: p
    for p in (
        Projection(
            "node",
            t.Node.__table__,
            "node",
            "nodes",
            _view_row,
            _load_view("nodes", NodeView, "node"),
        ),
        Projection(
            "shard",
            t.Shard.__table__,
            "shard_id",
            "shards",
            _view_row,
            _load_view("shards", ShardView, "shard_id"),
        ),
        Projection(
            "replica",
            t.Replica.__table__,
            "replica_id",
            "replicas",
            _view_row,
            _load_view("replicas", ReplicaView, "replica_id"),
        ),
        Projection(
            "model",
            t.Model.__table__,
            "name",
            "models",
            lambda k, m: _message_row(m),
            _load_message("models", c.ModelDeclared, "name"),
        ),
        Projection(
            "tenant",
            t.Tenant.__table__,
            "name",
            "tenants",
            lambda k, m: _message_row(m),
            _load_message("tenants", c.TenantDeclared, "name"),
        ),
        Projection(
            "failure",
            t.PlacementFailure.__table__,
            "replica_id",
            "failures",
            lambda k, m: _message_row(m),
            _load_message("failures", c.PlacementFailed, "replica_id"),
        ),
        Projection(
            "scaled",
            t.ModelScaling.__table__,
            "model",
            "scaled",
            lambda k, m: _message_row(m),
            _load_scaling,
            lambda k: {"model": k[0], "role": k[1]},
        ),
        Projection(
            "adapter",
            t.Adapter.__table__,
            "name",
            "adapters",
            lambda k, m: _message_row(m),
            _load_message("adapters", c.AdapterDeclared, "name"),
        ),
        Projection(
            "holdings",
            t.AdapterHolding.__table__,
            "model",
            "adapter_holdings",
            _view_row,
            _load_view("adapter_holdings", AdapterHoldings, "model"),
        ),
    )
}

BANDS_TABLE: Table = t.BandRow.__table__
STATE_TABLES: list[Table] = [p.table for p in PROJECTIONS.values()] + [BANDS_TABLE]


def band_rows(state: ClusterState) -> list[Row]:
    return [dict(msgspec.to_builtins(b), position=i) for i, b in enumerate(state.bands)]


@dataclass
class Writes:
    """What one batch writes to the state tables: upserts and deletes per table."""

    upserts: dict[str, list[Row]]
    deletes: dict[str, list[ChangeKey]]  # state keys (PROJECTIONS[kind].primary_key: columns)
    bands: list[Row] | None  # replace every band row when set


def writes_for(state: ClusterState, changes: Iterable[Change]) -> Writes:
    """The rows to write so the tables equal `state` again after `changes`."""
    keys: dict[str, set[ChangeKey]] = {}
    bands = False
    for kind, key in changes:
        if kind == ch.BANDS:
            bands = True
            continue
        if kind == ch.TERM:
            continue  # stored with the position (store.write_batch), not in a table
        if kind not in PROJECTIONS:
            raise ValueError(f"change kind {kind!r} has no projection table (see rows.py)")
        keys.setdefault(kind, set()).add(key)
    upserts: dict[str, list[Row]] = {}
    deletes: dict[str, list[ChangeKey]] = {}
    for kind, kind_keys in keys.items():
        proj = PROJECTIONS[kind]
        entries = proj.entries(state)
        for key in sorted(kind_keys):
            entry = entries.get(key)
            if entry is None:
                deletes.setdefault(proj.table.name, []).append(key)
            else:
                upserts.setdefault(proj.table.name, []).append(proj.to_row(key, entry))
    return Writes(upserts, deletes, band_rows(state) if bands else None)


def all_rows(state: ClusterState) -> dict[str, dict[ChangeKey, Row]]:
    """Every state table's rows by primary key, as the projection should hold them."""
    out = {
        p.table.name: {key: p.to_row(key, entry) for key, entry in p.entries(state).items()}
        for p in PROJECTIONS.values()
    }
    out[BANDS_TABLE.name] = {row["name"]: row for row in band_rows(state)}
    return out


def state_from_rows(rows: dict[str, list[Row]], last_seq: int) -> ClusterState:
    state = ClusterState(last_seq=last_seq)
    for proj in PROJECTIONS.values():
        for row in rows.get(proj.table.name, []):
            proj.load(state, row)
    ordered = sorted(rows.get(BANDS_TABLE.name, []), key=lambda r: r["position"])
    state.bands = [
        msgspec.convert({k: v for k, v in r.items() if k != "position"}, c.Band) for r in ordered
    ]
    return state


# ------------------------------------------------------------------ event-derived rows


def archive_row(seq: int, subject: str, raw: bytes, event: c.Message) -> Row:
    return {
        "seq": seq,
        "subject": subject,
        "type": c.type_tag(type(event)),
        "msg_id": event.id,
        "ts": event.ts,
        "payload": raw,
    }


def decision_row(seq: int, event: c.Message) -> Row | None:
    """A row of the placement history for PlacementDecided / PlacementFailed, else None."""
    if isinstance(event, c.PlacementDecided):
        outcome, assignments = "decided", msgspec.to_builtins(event.assignments)
        adopted = event.adopted
    elif isinstance(event, c.PlacementFailed):
        outcome, assignments, adopted = "failed", [], False
    else:
        return None
    return {
        "seq": seq,
        "outcome": outcome,
        "model": event.model,
        "replica_id": event.replica_id,
        "based_on_seq": event.based_on_seq,
        "assignments": assignments,
        "adopted": adopted,
        "verdicts": msgspec.to_builtins(event.verdicts),
        "verdict_groups": msgspec.to_builtins(event.verdict_groups),
        "explanation": event.explanation,
        "ts": event.ts,
        "role": event.role,
    }
