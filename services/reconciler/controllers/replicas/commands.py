"""Outstanding commands to agents: send once, re-issue with backoff until answered.

The reconciler says, after every change, which commands the state calls for
(`reconcile.commands`). `CommandTracker.sync(desired, now)` compares that with
what is outstanding: a new key is sent at once; a key no longer called for is
closed (the agent's shard-status event moved the shard on, so the command was
answered); an outstanding key whose backoff has run out is re-issued. The
clock is a parameter, so the tracker is tested without sleeping: a monotonic
one (`now`), since a wall-clock step back would hold every re-issue for as
long as the step; a re-issued command is stamped with the wall time `ts`.

A re-issue keeps the command's idempotency `key` (the agent dedupes on it) but
gets a fresh message id: the commands stream dedupes on message id inside its
duplicate window and would otherwise swallow the re-issue.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from llmgw import contracts as c


@dataclass
class Outstanding:
    command: c.Message
    first_sent: float
    next_at: float
    attempts: int = 1


class CommandTracker:
    def __init__(self, initial: float = 2.0, maximum: float = 30.0):
        self.initial = initial
        self.maximum = maximum
        self.outstanding: dict[str, Outstanding] = {}
        self.reissued = 0  # total re-issues, for metrics

    def _backoff(self, attempts: int) -> float:
        return min(self.maximum, self.initial * 2 ** (attempts - 1))

    def sync(
        self,
        desired: list[c.Message],
        now: float,
        ts: float | None = None,
        *,
        keep_new: bool = True,
    ) -> tuple[list[c.Message], list[c.Message]]:
        """Close what is no longer wanted; return what to send now: (new, re-issued).

        A wanted key whose command changed (another term, a new boot of the node)
        is sent again as new: the agent drops the old one. `keep_new=False`
        only forgets and re-issues (new commands wait for a later sync).
        """
        wanted = {cmd.key: cmd for cmd in desired}  # type: ignore[attr-defined]
        for key in [k for k in self.outstanding if k not in wanted]:
            del self.outstanding[key]
        out: list[c.Message] = []
        for key, cmd in wanted.items():
            held = self.outstanding.get(key)
            if held is not None and _content(held.command) != _content(cmd):
                del self.outstanding[key]
                held = None
            if held is None and keep_new:
                self.outstanding[key] = Outstanding(cmd, now, now + self._backoff(1))
                out.append(cmd)
        return out, self.due(now, ts)

    def due(self, now: float, ts: float | None = None) -> list[c.Message]:
        """Outstanding commands whose backoff ran out, each with a fresh message id and
        stamped `ts` (wall time; default `now`)."""
        out: list[c.Message] = []
        for entry in self.outstanding.values():
            if entry.next_at > now:
                continue
            entry.attempts += 1
            entry.next_at = now + self._backoff(entry.attempts)
            entry.command = msgspec.structs.replace(
                entry.command, id=c.new_id(), ts=now if ts is None else ts
            )
            self.reissued += 1
            out.append(entry.command)
        return out

    def next_due(self) -> float | None:
        return min((e.next_at for e in self.outstanding.values()), default=None)

    def clear(self) -> None:
        self.outstanding.clear()


def _content(cmd: c.Message) -> c.Message:
    return msgspec.structs.replace(cmd, id="", ts=0.0)
