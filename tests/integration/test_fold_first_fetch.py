"""A fresh consumer's first fetch lost in transit must not lose events either.

A new consumer's first delivery may start past the fold's position (the events
in between expired or were deleted), so its first batch is not held to
position + 1. But if that first fetch's response is lost (the server delivered
seqs 1..3, the client never saw them), the second fetch brings 4..6: folded as
a "first delivery", they would move the position past 1..3 and AckPolicy.ALL
would acknowledge them, gone for good. The delivery's consumer sequence (1 on a
new consumer's first message, never skipping) tells the two apart.
"""

from __future__ import annotations

from llmgw.reconciler.store import tables as t

from .lostfetch import fold_ten_losing_fetch
from .test_reconciler_store import count


async def test_a_fresh_consumers_lost_first_fetch_is_read_again(js, engine):
    first, folder, resubscribed = await fold_ten_losing_fetch(
        js, engine, "first-fetch-fold", lose=1
    )
    assert first.lost == [1, 2, 3]  # delivered by the server, never seen by the fold
    assert set(folder.state.nodes) == {f"n{i}" for i in range(10)}
    assert await count(engine, t.ArchivedEvent) == 10
    assert await count(engine, t.DeadLetter) == 0
    assert resubscribed == [1, 1]  # read again from the fold's position + 1
