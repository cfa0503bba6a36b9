"""Fold a batch of log entries into the state and commit it with its stream sequence.

The consumer hands over entries in stream order. For each one above the stored
position: decode it, dead-letter it if it is not a well-formed event that its
subject may carry (or a duplicate of an event already folded), else fold it
and archive it. Then one transaction writes everything the batch did and moves
the position to the batch's last sequence. Entries at or below the position
are skipped: redelivery after a crash between commit and ack changes nothing.

If the fold itself raises on an event (a bug, not bad input), the in-memory
state may be half-changed: it is reloaded from Postgres, the batch is folded
again with that event dead-lettered, and the fold goes on.

An event can also be well-formed yet carry a value Postgres refuses (a NUL
character in a string, an integer beyond a column's range): the batch's
commit fails without saying which event did it. The state is reloaded and the
batch folded again one event per transaction; the event whose commit is
refused is dead-lettered with the database's reason, and the fold goes on.

An event the state refuses (checks.py: an older leader term, a decision that
books a held GPU, a status for another node's shard) is dead-lettered too.

The state is changed in memory before its transaction commits. `gate` is
closed from the first change of a batch until its commit (or until the state
is reloaded after a failed one): readers outside the fold (the controllers)
wait for it to open, so they only ever see committed state.

The position never passes events without a trace. When the batch starts past
position + 1 (the consumer lets only a new consumer's real first delivery do
that: the events in between were gone from the stream, expired by retention or
deleted), the hole is recorded in the same transaction as one dead letter at
its first sequence, with no bytes and a reason naming the range: an operator
sees it in `/api/dead-letters` and in `llmgw_reconciler_events_never_folded_total`.
"""

from __future__ import annotations

import logging
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import asyncpg
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw import contracts as c
from llmgw import logs, subjects
from llmgw.reconciler.intake.gate import CommitGate
from llmgw.reconciler.state import checks, fold
from llmgw.reconciler.state.changes import Change
from llmgw.reconciler.state.model import ClusterState
from llmgw.reconciler.store import rows as r
from llmgw.reconciler.store import store

log = logging.getLogger(__name__)

EVENT_TYPES: tuple[type[c.Message], ...] = typing.get_args(c.EventMessage)
_AGENT_EVENTS = typing.get_args(c.AgentEvent)


class Entry(NamedTuple):
    """One message of the log: stream sequence, subject, raw bytes."""

    seq: int
    subject: str
    data: bytes


@dataclass
class BatchResult:
    folded: int = 0
    skipped: int = 0  # at or below the stored position (redelivered)
    dead: int = 0
    last_seq: int = 0
    never_folded: int = 0  # gone from the stream before the fold reached them
    changes: set[Change] = field(default_factory=set)

    def add(self, part: BatchResult) -> None:
        self.folded += part.folded
        self.dead += part.dead
        self.never_folded += part.never_folded
        self.last_seq = max(self.last_seq, part.last_seq)
        self.changes |= part.changes


def classify(subject: str, data: bytes) -> c.Message | str:
    """The event, or the reason it must be dead-lettered."""
    try:
        event = c.decode(data)
    except c.ContractError as exc:
        return f"malformed: {exc.reason}"
    if not isinstance(event, EVENT_TYPES):
        return f"not an event: {c.type_tag(type(event))} does not belong in the event log"
    if isinstance(event, _AGENT_EVENTS) and subjects.node_of_subject(subject) != event.node:
        # Agents may publish only under their own node's prefix; an event about
        # another node on this subject is an impersonation or a bug.
        return f"subject {subject} does not belong to node {event.node!r}"
    return event


class _FoldCrash(Exception):
    def __init__(self, seq: int, reason: str):
        self.seq = seq
        self.reason = reason


class _Refused(Exception):
    """The database refused a value the batch carried (SQLSTATE class 22, or asyncpg's
    own range checks); anything else (connection lost, fenced) is not bad input."""

    def __init__(self, reason: str):
        self.reason = reason


def _refused_reason(exc: DBAPIError) -> str | None:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, asyncpg.DataError):
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    return None


def replace_contents(state: ClusterState, fresh: ClusterState) -> None:
    """Make `state` equal `fresh` in place: the actor keeps a reference to the object."""
    for name in state.__struct_fields__:
        setattr(state, name, getattr(fresh, name))


class Folder:
    def __init__(
        self,
        engine: AsyncEngine,
        state: ClusterState,
        *,
        position_name: str = store.POSITION_NAME,
        clock: Callable[[], float] = time.time,
        gate: CommitGate | None = None,
    ):
        self.engine = engine
        self.state = state
        self.position_name = position_name
        self.clock = clock
        self.gate = gate or CommitGate()

    async def fold_batch(self, entries: Sequence[Entry]) -> BatchResult:
        fresh = [e for e in entries if e.seq > self.state.last_seq]
        skipped = len(entries) - len(fresh)
        if not fresh:
            return BatchResult(skipped=skipped, last_seq=self.state.last_seq)
        poison: dict[int, str] = {}
        try:
            result = await self._fold_until_done(fresh, poison)
        except _Refused:
            result = BatchResult()
            for entry in fresh:
                try:
                    part = await self._fold_until_done([entry], poison)
                except _Refused as refused:
                    poison[entry.seq] = f"refused by the database: {refused.reason}"
                    part = await self._fold_until_done([entry], poison)
                result.add(part)
        result.skipped = skipped
        return result

    async def _fold_until_done(
        self, entries: Sequence[Entry], poison: dict[int, str]
    ) -> BatchResult:
        """Fold and commit, dead-lettering events the fold crashes on; _Refused (with the
        state reloaded) when the database refuses the batch's data."""
        while True:
            try:
                result = await self._fold_and_commit(entries, poison)
                self.gate.open()
                return result
            except _FoldCrash as crash:
                token = logs.event_seq.set(crash.seq)
                log.exception("fold failed at seq %d; dead-lettering it", crash.seq)
                logs.event_seq.reset(token)
                poison[crash.seq] = crash.reason
                replace_contents(self.state, await store.load_state(self.engine))
                self.gate.open()
            except DBAPIError as exc:
                reason = _refused_reason(exc)
                if reason is None:
                    raise
                log.warning(
                    "the database refused a value in seqs %d..%d (%s); folding them one by one",
                    entries[0].seq,
                    entries[-1].seq,
                    reason,
                )
                replace_contents(self.state, await store.load_state(self.engine))
                self.gate.open()
                raise _Refused(reason) from None

    async def _fold_and_commit(
        self, entries: Sequence[Entry], poison: dict[int, str]
    ) -> BatchResult:
        state = self.state
        first_seq = state.last_seq
        now = self.clock()
        decoded = [(e, poison.get(e.seq) or classify(e.subject, e.data)) for e in entries]
        ids = [ev.id for _, ev in decoded if not isinstance(ev, str)]
        result = BatchResult()
        archive: list[r.Row] = []
        decisions: list[r.Row] = []
        dead: list[r.Row] = []
        if entries and entries[0].seq > first_seq + 1:
            missed = (first_seq + 1, entries[0].seq - 1)
            result.never_folded = missed[1] - missed[0] + 1
            dead.append(_gap_row(*missed, now))
        async with self.engine.begin() as conn:
            seen = await store.known_ids(conn, ids)
            # Open again only once committed (or reloaded): see the module docstring.
            self.gate.close()
            for entry, event in decoded:
                if not isinstance(event, str) and event.id in seen:
                    event = f"duplicate: event id {event.id} was folded at seq {seen[event.id]}"
                if not isinstance(event, str) and (why := checks.refusal(state, event)):
                    event = f"refused: {why}"
                if isinstance(event, str):
                    dead.append(_dead_row(entry, event, now))
                    state.last_seq = entry.seq
                    continue
                try:
                    result.changes |= fold.apply(state, entry.seq, event)
                except Exception as exc:
                    raise _FoldCrash(
                        entry.seq, f"fold failed: {type(exc).__name__}: {exc}"
                    ) from exc
                seen[event.id] = entry.seq
                archive.append(r.archive_row(entry.seq, entry.subject, entry.data, event))
                row = r.decision_row(entry.seq, event)
                if row is not None:
                    decisions.append(row)
            batch = store.BatchWrites(
                first_seq=first_seq,
                last_seq=state.last_seq,
                term=state.term,
                state=r.writes_for(state, result.changes),
                archive=archive,
                decisions=decisions,
                dead_letters=dead,
            )
            await store.write_batch(conn, batch, self.position_name)
        if result.never_folded:
            log.error(
                "events %d..%d were gone from the stream (expired or deleted) before they were "
                "folded: recorded as a dead letter; the state lacks whatever they said",
                first_seq + 1,
                entries[0].seq - 1,
            )
        for row in dead:
            log.warning("dead-lettered seq %d on %s: %s", row["seq"], row["subject"], row["reason"])
        result.folded = len(archive)
        result.dead = len(dead)
        result.last_seq = state.last_seq
        return result


def _gap_row(first: int, last: int, now: float) -> r.Row:
    span = f"event {first} was" if first == last else f"events {first}..{last} were"
    return {
        "seq": first,
        "subject": "",
        "reason": f"never folded: {span} gone from the stream (expired or deleted) "
        "before the fold reached them",
        "raw": b"",
        "received_at": now,
    }


def _dead_row(entry: Entry, reason: str, now: float) -> r.Row:
    return {
        "seq": entry.seq,
        "subject": entry.subject,
        "reason": reason,
        "raw": entry.data,
        "received_at": now,
    }
