"""A fetch lost in transit must not lose events.

During a JetStream election a pull request's response can vanish after the
server delivered its messages: they sit unacknowledged until ack_wait while the
next fetch brings later ones. Folded as they come, the later ones would move the
fold's position past the lost ones (which it then ignores as redeliveries) and
AckPolicy.ALL would acknowledge them: gone from the projection and the archive.
The consumer loop notices the gap and reads again from the fold's position.
"""

from __future__ import annotations

import pytest

from llmgw.reconciler.intake import consumer
from llmgw.reconciler.store import tables as t

from .lostfetch import fold_ten_losing_fetch
from .test_reconciler_store import count


async def test_a_lost_fetch_is_read_again_before_later_events(js, engine):
    first, folder, resubscribed = await fold_ten_losing_fetch(js, engine, "gap-fold", lose=2)
    assert first.lost == [4, 5, 6]  # delivered by the server, never seen by the fold
    assert set(folder.state.nodes) == {f"n{i}" for i in range(10)}
    assert await count(engine, t.ArchivedEvent) == 10
    assert await count(engine, t.DeadLetter) == 0
    assert folder.state.last_seq == 10
    assert resubscribed == [1, 4]  # read again from the fold's position + 1


@pytest.mark.parametrize(
    ("seqs", "folded", "fresh", "gap"),
    [
        ([4, 5, 6], 3, False, None),  # continues the fold
        ([7, 8, 9], 3, False, 4),  # 4..6 went missing
        ([2, 3, 4, 5], 3, False, None),  # redeliveries first, then new ones in order
        ([4, 6], 3, False, 5),  # a hole inside the batch
        ([9, 10], 3, True, None),  # a fresh consumer's first delivery: 4..8 do not exist
        ([9, 11], 3, True, 10),
        ([1, 2, 3], 3, False, None),  # nothing new
    ],
)
def test_first_gap(seqs, folded, fresh, gap):
    assert consumer.first_gap(seqs, folded, fresh) == gap
