"""What a command means given what the agent already knows about its shard. Pure.

Commands are idempotent by shard id and command key. The reconciler re-issues a
command it has not seen answered, so a repeat must never start a second engine or
restart a drain: it is answered with the shard's current state instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from llmgw import contracts as c

S = c.ShardState


class Action(enum.Enum):
    ANSWER = "answer"  # publish the current state for this command's key; change nothing
    LAUNCH = "launch"
    STOP = "stop"
    DRAIN = "drain"
    ADAPTERS = "adapters"  # the engine's adapters to hold: loaded and unloaded to match


@dataclass(frozen=True)
class KnownShard:
    """What the agent already knows of a command's shard: all a decision reads."""

    state: c.ShardState
    keys: frozenset[str]  # every command key already handled for this shard
    stopping: bool = False  # a stop is under way (SIGTERM sent or about to be)


def decide(cmd: c.Command, shard: KnownShard | None) -> Action:
    terminal = shard is not None and shard.state in c.TERMINAL_SHARD_STATES
    if shard is not None and cmd.key in shard.keys:
        return Action.ANSWER
    match cmd:
        case c.StartShard():
            # A live shard is never started twice, whatever the key: stop it first.
            # A stopped or failed one may start again under a new key.
            return Action.LAUNCH if shard is None or terminal else Action.ANSWER
        case c.StopShard():
            if shard is None or terminal or shard.stopping:
                return Action.ANSWER  # nothing runs, or the stop is already on its way
            return Action.STOP  # also cuts a drain short
        case c.DrainShard():
            if shard is None or terminal or shard.stopping or shard.state == S.DRAINING:
                return Action.ANSWER
            if shard.state == S.READY:
                return Action.DRAIN
            return Action.STOP  # launching or loading: no requests to wait for
        case c.SetShardAdapters():
            # Kept for a shard still loading too: its engine gets them once it serves.
            return Action.ANSWER if shard is None or terminal else Action.ADAPTERS
    raise TypeError(f"not a command: {type(cmd).__name__}")


def answer_state(shard: KnownShard | None) -> c.ShardState:
    """The state reported for an ANSWER: an unknown shard is, as far as this node knows, stopped."""
    return S.STOPPED if shard is None else shard.state
