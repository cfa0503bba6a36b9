"""Command idempotency: a repeated command never starts a second engine."""

import pytest

from llmgw import contracts as c
from llmgw.agent.decide import Action, KnownShard, answer_state, decide

S = c.ShardState
PROFILE = c.ServingProfile()


def start(key="k-start"):
    return c.StartShard(
        key=key, node="n", shard_id="s", model="m", replica_id="r", profile=PROFILE, gpus=["g"]
    )


def stop(key="k-stop"):
    return c.StopShard(key=key, node="n", shard_id="s")


def drain(key="k-drain"):
    return c.DrainShard(key=key, node="n", shard_id="s")


def adapters(key="k-ad"):
    src = [c.AdapterSource(name="a1", source="/adapters/a1")]
    return c.SetShardAdapters(key=key, node="n", shard_id="s", adapters=src)


def view(state, keys=(), stopping=False):
    return KnownShard(state=state, keys=frozenset(keys), stopping=stopping)


@pytest.mark.parametrize(
    ("cmd", "shard", "action"),
    [
        (start(), None, Action.LAUNCH),
        # A re-issued start (same key) or a second start (new key) for a live shard: answer.
        (start(), view(S.LOADING, {"k-start"}), Action.ANSWER),
        (start("k-other"), view(S.READY, {"k-start"}), Action.ANSWER),
        (start("k-other"), view(S.DRAINING, {"k-start"}), Action.ANSWER),
        # The same key after a failure is answered with the failure, not retried...
        (start(), view(S.FAILED, {"k-start"}), Action.ANSWER),
        # ...a new key after a failure or a stop starts it again.
        (start("k-retry"), view(S.FAILED, {"k-start"}), Action.LAUNCH),
        (start("k-again"), view(S.STOPPED, {"k-start", "k-stop"}), Action.LAUNCH),
        (stop(), None, Action.ANSWER),
        (stop(), view(S.READY, {"k-start"}), Action.STOP),
        (stop(), view(S.LOADING, {"k-start"}), Action.STOP),
        (stop(), view(S.DRAINING, {"k-start", "k-drain"}), Action.STOP),  # cuts a drain short
        (stop(), view(S.READY, {"k-start", "k-stop"}, stopping=True), Action.ANSWER),
        (stop("k-stop-2"), view(S.READY, {"k-stop"}, stopping=True), Action.ANSWER),
        (stop(), view(S.STOPPED, {"k-start"}), Action.ANSWER),
        (drain(), view(S.READY, {"k-start"}), Action.DRAIN),
        (drain(), view(S.DRAINING, {"k-start", "k-drain"}), Action.ANSWER),
        (drain("k-drain-2"), view(S.DRAINING, {"k-drain"}), Action.ANSWER),
        (drain(), view(S.LOADING, {"k-start"}), Action.STOP),  # nothing to drain yet
        (drain(), view(S.READY, {"k-stop"}, stopping=True), Action.ANSWER),
        (drain(), view(S.FAILED, {"k-start"}), Action.ANSWER),
        (drain(), None, Action.ANSWER),
        # Adapters: kept for a live shard (a loading one loads them once it serves)...
        (adapters(), view(S.READY, {"k-start"}), Action.ADAPTERS),
        (adapters(), view(S.LOADING, {"k-start"}), Action.ADAPTERS),
        (adapters(), view(S.DRAINING, {"k-start"}), Action.ADAPTERS),
        # ...a repeat is an answer, and so is one for a shard that is gone or unknown.
        (adapters(), view(S.READY, {"k-start", "k-ad"}), Action.ANSWER),
        (adapters(), view(S.STOPPED, {"k-start"}), Action.ANSWER),
        (adapters(), None, Action.ANSWER),
    ],
)
def test_decide(cmd, shard, action):
    assert decide(cmd, shard) is action


def test_an_unknown_shard_is_answered_as_stopped():
    assert answer_state(None) is S.STOPPED
    assert answer_state(view(S.READY)) is S.READY
