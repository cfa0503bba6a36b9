"""Command tracking: send once, re-issue with backoff until the state answers it."""

from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas.commands import CommandTracker


def stop(shard: str) -> c.StopShard:
    return c.StopShard(key=f"{shard}:stop", node="a", shard_id=shard)


def test_new_commands_go_at_once_and_reissues_back_off_with_the_same_key():
    t = CommandTracker(initial=2.0, maximum=5.0)
    cmd = stop("s1")
    new, again = t.sync([cmd], now=100.0)
    assert new == [cmd] and again == []
    assert t.sync([cmd], now=101.9) == ([], [])  # not due yet
    sent_at = []
    for now in (102.0, 104.0, 106.0, 108.0, 111.0, 116.0, 121.0):
        _, again = t.sync([cmd], now=now)
        if again:
            sent_at.append(now)
            assert again[0].key == "s1:stop" and again[0].id != cmd.id  # fresh id: no dedupe
    # backoff 2, 4, then capped at 5
    assert sent_at == [102.0, 106.0, 111.0, 116.0, 121.0]
    assert t.reissued == 5


def test_a_command_no_longer_called_for_is_closed():
    t = CommandTracker(initial=1.0)
    t.sync([stop("s1"), stop("s2")], now=0.0)
    new, again = t.sync([stop("s2")], now=10.0)  # s1's shard reported stopped
    assert new == [] and [x.key for x in again] == ["s2:stop"]
    assert set(t.outstanding) == {"s2:stop"}
    assert t.next_due() == 12.0
