"""The reconciler's commands to this node: pulled, fenced, applied, answered.

Commands come from the node's durable JetStream consumer, so one the agent did not
acknowledge comes again. Each is first fenced (a command for an earlier boot of this
node, or from a leader older than one already heard from, is dropped unanswered),
then `decide` says what it means for the shard as the agent knows it, and every
applied command is answered with a shard status: a repeat is answered, never redone.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from llmgw import bus, subjects
from llmgw import contracts as c

from .decide import Action, KnownShard, answer_state, decide
from .launcher import Launcher
from .outbox import Outbox, status_of
from .shard import EngineShard
from .telemetry import COMMAND_KINDS, AgentMetrics

log = logging.getLogger(__name__)

FETCH_BATCH = 16
STREAM_NOT_FOUND = 10059  # JetStream API error code


class Commands:
    """Applies commands to the agent's shards; `consume` is the task that pulls them
    (the agent owns and cancels that task)."""

    def __init__(
        self,
        node: str,
        boot_id: str,
        shards: dict[str, EngineShard],
        launcher: Launcher,
        outbox: Outbox,
        metrics: AgentMetrics,
        ensure_streams: Callable[[], Awaitable[None]],
    ):
        self.node = node
        self.boot_id = boot_id
        self.shards = shards  # the agent's, by shard id
        self.launcher = launcher
        self.outbox = outbox
        self.metrics = metrics
        self.ensure_streams = ensure_streams  # when the consumer finds no stream
        self.leader_term = 0  # the newest reconciler term a command came from
        self._rebind = False

    def rebind(self) -> None:
        """Bind the consumer again before the next fetch (after a reconnect)."""
        self._rebind = True

    async def consume(self, js: JetStreamContext) -> None:
        sub = None
        delay = 0.2
        while True:
            try:
                if sub is None or self._rebind:
                    self._rebind = False
                    sub = await bus.ensure_pull_consumer(
                        js,
                        subjects.COMMANDS_STREAM,
                        durable=f"agent-{self.node}",
                        filter_subject=subjects.commands(self.node),
                    )
                msgs = await sub.fetch(FETCH_BATCH, timeout=1.0)
            except TimeoutError:
                continue  # nothing to do
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("command consumer failed (%s); re-binding", exc)
                if isinstance(exc, NotFoundError) and exc.err_code == STREAM_NOT_FOUND:
                    await self.ensure_streams()
                sub = None
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.2
            for msg in msgs:
                try:
                    await self._on_msg(msg)
                except Exception as exc:  # an ack lost to a disconnect: the command comes again
                    log.warning("command acknowledgement failed: %s", exc)

    async def _on_msg(self, msg) -> None:
        try:
            cmd = c.decode(msg.data, c.Command)
        except c.ContractError as exc:
            # Dead letter: logged with its payload and terminated, never redelivered.
            log.error("dead letter on %s: %s; payload %r", msg.subject, exc.reason, msg.data[:500])
            self.metrics.commands_received.labels("unknown").inc()
            self.metrics.commands_rejected.labels("unknown", "malformed").inc()
            await msg.term()
            return
        self.metrics.commands_received.labels(COMMAND_KINDS[type(cmd)]).inc()
        try:
            self.handle(cmd)
        except Exception:
            log.exception("command %s (%s) could not be handled", cmd.key, type(cmd).__name__)
            self.metrics.commands_rejected.labels(COMMAND_KINDS[type(cmd)], "error").inc()
            await msg.term()
            return
        await msg.ack()

    def handle(self, cmd: c.Command) -> None:
        """Apply one command; every command is answered with a shard status."""
        kind = COMMAND_KINDS[type(cmd)]
        if cmd.node != self.node:
            log.error("command %s is for node %s, not %s: ignored", cmd.key, cmd.node, self.node)
            self.metrics.commands_rejected.labels(kind, "wrong_node").inc()
            return
        stale = self._stale(cmd)
        if stale is not None:
            self.metrics.commands_rejected.labels(kind, stale).inc()
            return
        shard = self.shards.get(cmd.shard_id)
        known = None
        if shard is not None:
            known = KnownShard(shard.rec.state, frozenset(shard.rec.keys), shard.rec.stopping)
        action = decide(cmd, known)
        log.info(
            "command %s %s for shard %s: %s",
            type(cmd).__name__,
            cmd.key,
            cmd.shard_id,
            action.value,
        )
        if action is Action.LAUNCH:
            rejected = self.launcher.start(cmd, shard)
            if rejected is not None:
                self.metrics.commands_rejected.labels(kind, rejected).inc()
                return
        elif action is Action.STOP:
            # Answered by the `stopped` status once the engine is gone.
            shard.request_stop(cmd.key, cmd.grace_seconds if isinstance(cmd, c.StopShard) else 10.0)
        elif action is Action.DRAIN:
            shard.request_drain(cmd.key, cmd.deadline_seconds)
        elif action is Action.ADAPTERS:
            # Answered now with what the engine holds; its loads report as they finish.
            shard.set_adapters(cmd.key, cmd.adapters)
            self.outbox.enqueue(status_of(self.node, shard.rec, cmd.key))
        elif shard is None:
            self.outbox.enqueue(
                c.ShardStatus(
                    node=self.node,
                    shard_id=cmd.shard_id,
                    model="",
                    replica_id="",
                    state=answer_state(None),
                    command_key=cmd.key,
                    reason="no such shard on this node",
                )
            )
        else:
            shard.note_command(cmd.key)
            self.outbox.enqueue(status_of(self.node, shard.rec, cmd.key))
        self.metrics.commands_applied.labels(kind, action.value).inc()

    def _stale(self, cmd: c.Command) -> str | None:
        """Why a command is dropped unanswered: meant for an earlier boot of this node
        (a consumer replaying old commands), or sent by a leader older than one already
        heard from (a deposed leader's late write). The current leader re-sends what it
        still wants under its own term and this boot."""
        if cmd.boot_id and cmd.boot_id != self.boot_id:
            log.warning(
                "command %s is for boot %s of this node, this is boot %s: dropped",
                cmd.key,
                cmd.boot_id,
                self.boot_id,
            )
            return "stale_boot"
        if cmd.term < self.leader_term:
            log.warning(
                "command %s is from leader term %d, term %d already spoke: dropped",
                cmd.key,
                cmd.term,
                self.leader_term,
            )
            return "stale_term"
        self.leader_term = cmd.term
        return None
