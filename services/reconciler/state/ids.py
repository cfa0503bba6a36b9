"""Every id the reconciler makes, built and parsed in one place. Pure.

Ids are decided here and nowhere else, because the log, Postgres, the agents
and replay all hold them: a second builder that drifts by a character would
split one thing into two.

  - replica `<model token>-r<n>`: the model name made safe for a NATS subject
    token, then a number that is never reused (see `queries.next_replica_id`);
    a disaggregated model's pool replica `<model token>-<role>-r<n>` (role prefill
    or decode), numbered per pool, so an operator reads the pool in the id;
  - shard `<replica>-s<index>`: shard 0 is the one that serves HTTP (the
    endpoint id routers see, `llmgw.projection.endpoint_id`, is the rule
    across services and stays there);
  - event: a digest of what the decision is about, so a decision re-published
    (even by a new leader) is the same message and the stream dedupes it;
  - command key `<shard>:<action>`: an agent recognises a re-issued command as
    the same one (for a set of adapters, `<shard>:adapters@<digest of the set>.<seq of
    the decision>`).
"""

from __future__ import annotations

import hashlib

from llmgw import subjects


def replica_token(model: str, role: str = "") -> str:
    """The part of a replica id before `-r<n>`: the model's token, and the pool's role."""
    token = subjects.safe_token(model)
    return f"{token}-{role}" if role else token


def replica_id(model: str, n: int, role: str = "") -> str:
    return f"{replica_token(model, role)}-r{n}"


def parse_replica_id(rid: str) -> tuple[str, int] | None:
    """(token, n) of a replica id `<token>-r<n>`; None for an id not of that form."""
    head, sep, tail = rid.rpartition("-r")
    # ASCII digits only: str.isdigit() also accepts "²", which int() refuses, and a replica
    # id an agent reports must never crash the fold.
    return (head, int(tail)) if sep and tail.isascii() and tail.isdigit() else None


def replica_number(rid: str) -> int | None:
    """The n of a replica id `<token>-r<n>`; None for an id not of that form."""
    parsed = parse_replica_id(rid)
    return parsed[1] if parsed is not None else None


def shard_id(replica: str, index: int) -> str:
    return f"{replica}-s{index}"


def event_id(*parts: object) -> str:
    """A deterministic message id: a decision re-published (even by a new leader) dedupes."""
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:32]


def command_key(shard_id: str, action: str) -> str:
    """Deterministic, so the agent recognises a re-issued command as the same one."""
    return f"{shard_id}:{action}"


def adapters_key(shard_id: str, adapters: list[str], changed_seq: int) -> str:
    """The key of a SetShardAdapters: one per set of adapters and the decision that last
    changed the replica's set, so a re-issue is recognised and another set is a new
    command. That decision's seq is in it because an agent answers a key it has handled
    without redoing it: a set asked for again after another (A, then B, then A) had A's
    old key, and the engine kept B (bench_lora: an adapter placed for a minute while its
    requests waited for it, until they timed out). Not the model's latest decision's seq:
    a decision for another replica then re-sent a replica's slow load as new, and reset
    the agent's retries of it."""
    digest = hashlib.sha256("\x1f".join(sorted(adapters)).encode()).hexdigest()[:12]
    return command_key(shard_id, f"adapters@{digest}.{changed_seq}")
