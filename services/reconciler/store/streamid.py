"""Which event stream the database's position belongs to: checked at every leader term.

The stored position is a stream sequence, and a sequence means something only
in the stream that produced it. If NATS loses its storage and the stream is
created again under the same name, sequences restart at 1: folding from the
stored position + 1 would silently skip the new stream's first events
(agents' re-registrations among them) and fold the rest onto a state built
from another history. So the position row also records the stream's identity,
its creation time as JetStream reports it (stable across restarts, updates
and cluster leader changes; new when the stream is created again).

At each term start: nothing folded yet, or nothing recorded yet (a database
from before this check) -> record the identity; the same identity -> go on;
another -> refuse to fold and tell the operator what to do (`MISMATCH_HELP`).
A stream that ends before the position is refused the same way whatever its
identity (it cannot be the stream the position came from), and events that
expired before they were folded are said out loud (the folder also records
the hole as a dead letter).
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw import subjects
from llmgw.reconciler.store import store
from llmgw.reconciler.store import tables as t

log = logging.getLogger(__name__)

_position = t.ConsumerPosition.__table__

MISMATCH_HELP = (
    "Either restore the original stream (NATS storage from a backup) and restart, or start "
    "over from the new stream: stop every reconciler; keep the old history if you want it "
    "(llmgw events export --from-seq 1 > old-log.jsonl); reset the database "
    "(llmgw migrate --downgrade base, then llmgw migrate); start the reconcilers (they fold "
    "the new stream from seq 1; agents re-register when they reconnect); then apply the "
    "catalog again (llmgw apply -f catalog.yaml): the old stream's catalog events are gone."
)


class StreamMismatch(RuntimeError):
    """The event stream is not the one the stored position belongs to: do not fold it."""


def identity(info) -> str:
    """A stream's identity from its StreamInfo: its creation time, or '' if not reported."""
    created = getattr(info, "created", None)
    return created.isoformat() if created is not None else ""


def judge(*, stored: str, current: str, position: int, stream_last_seq: int) -> bool:
    """Whether `current` must be recorded as the position's stream (True), or is the
    recorded one already (False); StreamMismatch when the stream must not be folded."""
    if position == 0:
        return stored != current  # nothing folded: whatever stream this is, it is ours now
    if stream_last_seq < position:
        raise StreamMismatch(
            f"{subjects.EVENTS_STREAM} ends at seq {stream_last_seq} but the database has "
            f"folded up to seq {position}: the stream was recreated or is not this "
            f"database's. {MISMATCH_HELP}"
        )
    if not stored:
        return bool(current)  # recorded from now on; this once it cannot be checked
    if current and current != stored:
        raise StreamMismatch(
            f"{subjects.EVENTS_STREAM} was created at {current}, but the database folded "
            f"up to seq {position} of the stream created at {stored}: the stream was "
            f"deleted and created again (NATS lost its storage?), so its sequences mean "
            f"other events. Folding it from seq {position + 1} would skip its first "
            f"{position} events. {MISMATCH_HELP}"
        )
    return False


async def check(
    engine: AsyncEngine, js: JetStreamContext, position: int, name: str = store.POSITION_NAME
) -> str:
    """Refuse (StreamMismatch) a stream the position does not belong to; record the
    identity where it is not recorded yet; warn about events that expired unfolded.
    Returns the identity, for `still_the_same` during the term."""
    info = await js.stream_info(subjects.EVENTS_STREAM)
    current = identity(info)
    async with engine.begin() as conn:
        stored = (
            await conn.execute(select(_position.c.stream_created).where(_position.c.name == name))
        ).scalar_one_or_none() or ""
        record = judge(
            stored=stored, current=current, position=position, stream_last_seq=info.state.last_seq
        )
        if record:
            if stored:
                log.warning(
                    "nothing folded yet: adopting %s created at %s", info.config.name, current
                )
            elif position:
                log.warning(
                    "recording the identity of %s (created at %s) at seq %d; it could not be "
                    "checked this once",
                    subjects.EVENTS_STREAM,
                    current,
                    position,
                )
            # Compare-and-set on the position: only the term that loaded it records.
            await conn.execute(
                update(_position)
                .where(_position.c.name == name, _position.c.last_seq == position)
                .values(stream_created=current)
            )
    if info.state.first_seq > position + 1:
        log.error(
            "events %d..%d expired from %s before they were folded: they will be recorded as "
            "one dead letter and the fold continues from %d (the state may lack what they said)",
            position + 1,
            info.state.first_seq - 1,
            subjects.EVENTS_STREAM,
            info.state.first_seq,
        )
    return current


async def still_the_same(js: JetStreamContext, term_identity: str) -> None:
    """StreamMismatch if the stream was created again since the term began (checked
    whenever the fold makes a new consumer: one on a recreated stream would start at the
    old position and take the new stream's events after it for a first delivery)."""
    current = identity(await js.stream_info(subjects.EVENTS_STREAM))
    if term_identity and current and current != term_identity:
        raise StreamMismatch(
            f"{subjects.EVENTS_STREAM} was created again during this term (it was created "
            f"at {term_identity}, now at {current}): stopping the fold. {MISMATCH_HELP}"
        )
