"""Stale commands never run: an agent drops a command meant for an earlier boot of its node
(a consumer replaying old commands) or sent by a leader older than one it already heard
from; the reconciler re-sends a command whose fencing changed instead of repeating the old."""

from __future__ import annotations

import json

import pytest

from llmgw import bus, subjects
from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas.commands import CommandTracker
from tests.integration.test_agent_lifecycle import (
    Watch,
    agent_config,
    running_agent,
    start_cmd,
    status,
)

S = c.ShardState


@pytest.fixture
async def watch(nats):
    await bus.provision(nats.jetstream())
    return await Watch().start(nats, "llmgw.evt.agent.>")


async def test_an_agent_drops_commands_of_another_boot_or_an_older_term(
    nats, nats_url, watch, tmp_path
):
    js = nats.jetstream()
    async with running_agent(agent_config("n-stale", nats_url, tmp_path / "s")) as agent:
        boot = agent.boot_id
        # A day-old command for the node's previous boot, replayed by a recreated consumer.
        old_boot = fenced(start_cmd("n-stale", "old-boot"), boot_id="an-earlier-boot", term=5)
        # The current leader (term 5) speaks, then a deposed leader (term 4) writes late.
        current = fenced(
            start_cmd("n-stale", "current", gpus=["GPU-fake-n-stale-1"]), boot_id=boot, term=5
        )
        deposed = fenced(
            start_cmd("n-stale", "deposed", gpus=["GPU-fake-n-stale-2"]), boot_id=boot, term=4
        )
        after = fenced(c.StopShard(key="stop-after", node="n-stale", shard_id="nothing"), term=5)
        for raw in (old_boot, current, deposed, after):
            await js.publish(subjects.commands("n-stale"), raw)
        await watch.wait_for(status("current", S.READY))
        # Commands are handled in order: once the last is answered, the stale ones were seen.
        await watch.wait_for(status("nothing", S.STOPPED, key="stop-after"))
        assert watch.statuses("old-boot") == []
        assert watch.statuses("deposed") == []
        assert set(agent.shards) == {"current"}


def fenced(cmd: c.Message, **fencing) -> bytes:
    """The command as the wire carries it, with its fencing fields set."""
    body = json.loads(c.encode(cmd))
    body.update(fencing)
    return json.dumps(body).encode()


def test_a_command_whose_fencing_changed_is_sent_again_as_new_not_reissued_as_it_was():
    tracker = CommandTracker(initial=2.0, maximum=30.0)
    first = c.StopShard(key="s:stop", node="n", shard_id="s", term=1, boot_id="b1")
    new, again = tracker.sync([first], now=0.0)
    assert new == [first] and again == []
    # The node restarted (new boot): the old command would be dropped by the agent forever.
    rebooted = c.StopShard(key="s:stop", node="n", shard_id="s", term=1, boot_id="b2")
    new, again = tracker.sync([rebooted], now=0.5)
    assert [cmd.boot_id for cmd in new] == ["b2"] and again == []
    # And it is re-issued with the new boot once its back-off runs out.
    _, again = tracker.sync([rebooted], now=10.0)
    assert [cmd.boot_id for cmd in again] == ["b2"]


def test_commands_no_longer_wanted_are_not_reissued_while_decisions_wait():
    tracker = CommandTracker(initial=1.0, maximum=30.0)
    start = c.StopShard(key="x:stop", node="n", shard_id="x")
    tracker.sync([start], now=0.0)
    # Waiting for its own events to be folded, the controller sends nothing new but still
    # forgets what the committed state no longer calls for.
    new, again = tracker.sync([], now=5.0, keep_new=False)
    assert new == [] and again == []
    assert tracker.outstanding == {}
