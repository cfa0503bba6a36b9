"""The router projection's writer: puts the records into JetStream KV, and only what changed.

`KvProjection` writes a key only when its content changed, comparing the
record without its envelope (id, ts) and without `based_on_seq` and `term`
(`records.comparable`), so unrelated events never rewrite every key.

Every record carries the folded leader term. Writes are compare-and-set on
the revision this leader last saw for the key: an old leader's late write
fails instead of overwriting a newer one, and a write that finds the key
changed behind its back re-reads it and writes again. `load()` re-reads what
the buckets hold; the projection controller does that at term start and
periodically, then rewrites what differs (a late foreign write, a bucket
recreated empty).
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)

from llmgw import contracts as c
from llmgw import projection as pj
from llmgw.reconciler.controllers.projection.records import (
    Target,
    affected,
    all_keys,
    comparable,
    record_for,
)
from llmgw.reconciler.state.model import ClusterState

log = logging.getLogger(__name__)


class Superseded(RuntimeError):
    """A newer leader wrote the key: this one must not overwrite it."""


class KvProjection:
    """Writes the projection to KV; remembers what it wrote to skip unchanged keys."""

    def __init__(self, js: JetStreamContext, term: int = 0):
        self.js = js
        self.term = term  # the leader term writing: a key of a newer term is not ours
        self._kv: dict[str, object] = {}
        self._written: dict[Target, bytes] = {}  # (bucket, kv key) -> comparable
        self._rev: dict[Target, int] = {}  # (bucket, kv key) -> revision we saw
        self.writes = 0
        self.conflicts = 0  # writes that found the key changed by someone else

    async def _bucket(self, bucket: str):
        if bucket not in self._kv:
            self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def load(self) -> None:
        """Learn what the buckets hold now, so only what differs is rewritten."""
        written: dict[Target, bytes] = {}
        revs: dict[Target, int] = {}
        for bucket in pj.BUCKETS:
            kv = await self._bucket(bucket)
            try:
                keys = await kv.keys()
            except NoKeysError:
                continue
            for key in keys:
                body, rev, _ = await self._read(kv, (bucket, key))
                if rev is not None:
                    written[(bucket, key)] = body
                    revs[(bucket, key)] = rev
        self._written, self._rev = written, revs

    async def _read(self, kv, target: Target) -> tuple[bytes, int | None, int]:
        """(comparable, revision, leader term) of what a key holds; revision None: nothing."""
        try:
            entry = await kv.get(target[1])
        except (KeyNotFoundError, KeyDeletedError):
            return b"", None, 0
        try:
            record = pj.decode(*target, entry.value or b"")
        except c.ContractError:
            return b"?", entry.revision, 0  # unreadable or misplaced: rewrite or delete it
        return comparable(record), entry.revision, getattr(record, "term", 0)

    def full_plan(self, state: ClusterState) -> list[tuple[Target, pj.Record | None]]:
        """Every key the state projects, and a delete of every other key we know of. Pure."""
        wanted = all_keys(state)
        plan: list[tuple[Target, pj.Record | None]] = [
            (target, None) for target in sorted(set(self._written) - set(wanted))
        ]
        plan += [(target, record_for(state, wanted[target])) for target in sorted(wanted)]
        return plan

    async def sync_all(self, state: ClusterState) -> None:
        """Make the buckets match the state: write what differs, delete what is gone."""
        await self.apply(self.full_plan(state))

    def plan(self, state: ClusterState, changes) -> list[tuple[Target, pj.Record | None]]:
        """The (target, record or None) writes a set of changes calls for. Pure over `state`."""
        keys = sorted(affected(state, changes), key=lambda key: key.target)
        return [(key.target, record_for(state, key)) for key in keys]

    async def apply(self, plan: list[tuple[Target, pj.Record | None]]) -> None:
        for target, record in plan:
            if record is None:
                await self._delete(target)
            else:
                await self._write(target, record)

    async def _write(self, target: Target, record: pj.Record | None) -> None:
        if record is None:
            return
        body = comparable(record)
        if self._written.get(target) == body:
            return
        kv = await self._bucket(target[0])
        raw = pj.encode(record)
        for _attempt in range(3):
            rev = self._rev.get(target)
            try:
                if rev is None:
                    new_rev = await kv.create(target[1], raw)
                else:
                    new_rev = await kv.update(target[1], raw, last=rev)
            except KeyWrongLastSequenceError:
                # Someone else wrote it (an old leader's late put, an operator): look again.
                self.conflicts += 1
                log.warning("KV key %s/%s changed behind us: re-reading it", *target)
                found, seen, term = await self._read(kv, target)
                self._check_not_superseded(target, term)
                if seen is None:
                    self._rev.pop(target, None)
                else:
                    self._rev[target] = seen
                if found == body:
                    self._written[target] = body
                    return
                continue
            self._written[target] = body
            self._rev[target] = new_rev
            self.writes += 1
            return
        raise RuntimeError(f"KV key {target[0]}/{target[1]} keeps changing behind us")

    def _check_not_superseded(self, target: Target, term: int) -> None:
        if term > self.term:
            raise Superseded(
                f"KV key {target[0]}/{target[1]} was written by leader term {term}; "
                f"this leader's term is {self.term}: not overwriting it"
            )

    async def _delete(self, target: Target) -> None:
        if target not in self._written:
            return
        kv = await self._bucket(target[0])
        try:
            await kv.delete(target[1], last=self._rev.get(target))
        except KeyWrongLastSequenceError:
            self.conflicts += 1
            _, seen, term = await self._read(kv, target)
            self._check_not_superseded(target, term)
            if seen is not None:
                await kv.delete(target[1], last=seen)  # what is there now must go as well
        del self._written[target]
        self._rev.pop(target, None)
        self.writes += 1
