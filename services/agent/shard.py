"""Supervision of one engine process: readiness, crash detection, drain and stop.

One asyncio task per shard, owned by the Agent, follows the engine through
loading -> ready -> (draining) -> stopped, or failed. It never restarts an engine:
whether a failed shard runs again is the reconciler's decision. A shard with adapter
slots also keeps its engine's LoRA adapters at the set last asked for (lora.py), in a
task of its own that this one starts once the engine serves and ends before it stops.

Cancelling the task (agent shutdown) leaves the engine running; its record in the
state dir lets the next agent process pick up supervision where this one stopped.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from llmgw import contracts as c
from llmgw.engines import ENGINES
from llmgw.tasks import cancel_and_wait

from . import procs
from .lora import AdapterSync, EngineAdapters, Retry
from .metrics import Load, parse_load
from .state import ShardRecord, StateDir, tail

log = logging.getLogger(__name__)

S = c.ShardState


@dataclass(frozen=True)
class Timing:
    ready_timeout: float
    ready_poll: float
    headless_settle: float
    drain_settle: float
    tail_lines: int
    adapter_retry: Retry = Retry()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "the engine exited (exit status unknown: it was adopted after an agent restart)"
    if code < 0:
        try:
            return f"the engine was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the engine was killed by signal {-code}"
    return f"the engine exited with code {code}"


class EngineShard:
    def __init__(
        self,
        rec: ShardRecord,
        *,
        state_dir: StateDir,
        timing: Timing,
        emit: Callable[[ShardRecord], None],
        http: httpx.AsyncClient,
        probe_host: str,
        count_exit: Callable[[str], None],
        count_adapter_op: Callable[[str, str], None],  # (load|unload, outcome) for the metric
        proc: subprocess.Popen | None = None,
    ):
        self.rec = rec
        self.proc = proc  # our child; None for an engine adopted from an earlier agent
        self._state_dir = state_dir
        self._timing = timing
        self._emit = emit
        self._http = http
        self._probe_host = probe_host
        self._count_exit = count_exit  # the engine ended: why, as a bounded metric label
        self._count_adapter_op = count_adapter_op
        self._wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.adapters: AdapterSync | None = None  # while the engine serves, with slots
        self._adapters_task: asyncio.Task | None = None

    # ------------------------------------------------------------ record keeping

    def transition(self, state: c.ShardState, **fields) -> None:
        """Record and report a state change (persisted before it is published)."""
        if state in c.TERMINAL_SHARD_STATES and self.rec.adapters:
            self.rec.adapters = []  # an engine that is gone holds no adapter
        self.rec.state = state
        for name, value in fields.items():
            setattr(self.rec, name, value)
        self._state_dir.save(self.rec)
        self._emit(self.rec)
        log.info(
            "shard %s: %s%s",
            self.rec.shard_id,
            state.value,
            f" ({self.rec.reason})" if state == S.FAILED else "",
        )

    def note_command(self, key: str) -> None:
        """A command about this shard was handled: remember its key, answer it at the end."""
        if key not in self.rec.keys:
            self.rec.keys.append(key)
        if not self.rec.terminal:
            self.rec.command_key = key
        self._state_dir.save(self.rec)

    def request_stop(self, key: str, grace: float) -> None:
        self.note_command(key)
        self.rec.stopping = True
        self.rec.stop_grace = grace
        self._state_dir.save(self.rec)
        self._wake.set()

    def request_drain(self, key: str, deadline_seconds: float) -> None:
        self.note_command(key)
        now = time.time()
        self.transition(S.DRAINING, drain_started=now, drain_deadline=now + deadline_seconds)
        self._wake.set()

    @property
    def adapter_slots(self) -> int:
        start = self.rec.start
        if start is None or ENGINES[self.rec.engine].runtime_lora is None:
            return 0
        return start.profile.max_loras

    def set_adapters(self, key: str, adapters: list[c.AdapterSource]) -> None:
        """The whole set of adapters the engine should hold (SetShardAdapters)."""
        self.note_command(key)
        self.rec.desired_adapters = list(adapters)
        if not self.adapter_slots:
            self.rec.adapter_errors = {
                a.name: "the shard's profile has no adapter slots (profile.max_loras is 0)"
                for a in adapters
            }
        self._state_dir.save(self.rec)
        if self.adapters is not None:
            self.adapters.want(self.rec.desired_adapters)

    def report_adapters(self, held: list[str] | None, errors: dict[str, str]) -> None:
        """What the engine holds changed, or a call failed: the status says so."""
        if held == self.rec.adapters and errors == self.rec.adapter_errors:
            return
        self.rec.adapters = held
        self.rec.adapter_errors = errors
        self._state_dir.save(self.rec)
        self._emit(self.rec)
        log.info(
            "shard %s: adapters held %s%s",
            self.rec.shard_id,
            held,
            f", failed {sorted(errors)}" if errors else "",
        )

    def _start_adapters(self) -> None:
        """Keep the engine's adapters at the set asked for, while it serves."""
        api = ENGINES[self.rec.engine].runtime_lora
        if not self.adapter_slots or api is None or not self.rec.port or self.rec.terminal:
            return
        retry = self._timing.adapter_retry
        self.adapters = AdapterSync(
            self.rec.shard_id,
            EngineAdapters(self._http, self.base_url, api, retry.call_timeout),
            self.report_adapters,
            self._count_adapter_op,
            retry,
            self.rec.desired_adapters,
        )
        self._adapters_task = asyncio.create_task(
            self.adapters.run(), name=f"adapters-{self.rec.shard_id}"
        )

    async def _stop_adapters(self) -> None:
        await cancel_and_wait(self._adapters_task)
        self._adapters_task = None
        self.adapters = None

    @property
    def base_url(self) -> str:
        return f"http://{self._probe_host}:{self.rec.port}"

    # ------------------------------------------------------------ process facts

    def exit_code(self) -> tuple[bool, int | None]:
        """(exited, exit code); the code is unknown (None) for adopted engines."""
        if self.proc is not None:
            code = self.proc.poll()
            return code is not None, code
        pid = self.rec.pid
        alive = pid is not None and procs.is_alive(
            pid, self.rec.proc_start, self.rec.kernel_boot_id
        )
        return not alive, None

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when a command arrives."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        except TimeoutError:
            pass
        self._wake.clear()

    async def scrape(self, timeout: float) -> Load | None:
        try:
            resp = await self._http.get(f"{self.base_url}/metrics", timeout=timeout)
        except httpx.HTTPError:
            return None
        return parse_load(resp.text) if resp.status_code == 200 else None

    async def _healthy(self) -> bool:
        try:
            resp = await self._http.get(f"{self.base_url}/health", timeout=2.0)
        except httpx.HTTPError:
            return False  # port still closed (vLLM opens it only once loaded) or engine busy
        return resp.status_code == 200

    # ------------------------------------------------------------ lifecycle

    async def supervise(self) -> None:
        rec = self.rec
        if rec.state in (S.LAUNCHING, S.LOADING) and not rec.stopping:
            await self._await_ready()
        self._start_adapters()
        try:
            while not rec.terminal:
                if rec.stopping:
                    await self._stop_adapters()  # no load races the engine's exit
                    await self._stop()
                    return
                exited, code = self.exit_code()
                if exited:
                    await self._stop_adapters()
                    self.fail(code, describe_exit(code), "crashed")
                    return
                if rec.state == S.DRAINING and await self._drained():
                    rec.stopping = True
                    continue
                await self._pause(self._timing.ready_poll)
        finally:  # cancelled at agent shutdown: the engine stays, its adapters with it
            await self._stop_adapters()

    async def _await_ready(self) -> None:
        rec, t = self.rec, self._timing
        while not rec.stopping:
            exited, code = self.exit_code()
            if exited:
                self.fail(code, describe_exit(code) + " while loading", "crashed_while_loading")
                return
            waited = time.time() - rec.launched_at
            if rec.port:
                ready = await self._healthy()
            else:  # a headless rank serves no HTTP: alive long enough counts as up
                ready = waited >= t.headless_settle
            if ready:
                # A new engine holds no adapter; one with slots says so.
                self.transition(S.READY, adapters=[] if self.adapter_slots else None)
                return
            if waited > t.ready_timeout:
                await self._kill_group(grace=5.0)
                self.fail(
                    self.exit_code()[1], f"not ready within {t.ready_timeout:.0f}s", "ready_timeout"
                )
                return
            await self._pause(t.ready_poll)

    async def _drained(self) -> bool:
        """No running or waiting requests, or the deadline passed.

        Zero requests count only after `drain_settle` seconds in draining: until routers
        have seen the state, new requests may still arrive.
        """
        rec, now = self.rec, time.time()
        if rec.drain_deadline is not None and now >= rec.drain_deadline:
            log.info("shard %s: drain deadline reached", rec.shard_id)
            return True
        if not rec.port or now - (rec.drain_started or 0.0) < self._timing.drain_settle:
            return False
        load = await self.scrape(timeout=2.0)
        return load is not None and load.running == 0 and load.waiting == 0

    async def _stop(self) -> None:
        code = await self._kill_group(grace=self.rec.stop_grace)
        self._count_exit("stopped")
        self.transition(S.STOPPED, stopping=False, exit_code=code)

    async def _kill_group(self, grace: float) -> int | None:
        """SIGTERM to the engine's process group, SIGKILL after `grace`; returns the exit code."""
        pgid = self.rec.pid
        if pgid is None:
            return None
        procs.signal_group(pgid, signal.SIGTERM)
        if not await self._wait_exit(grace):
            log.warning(
                "shard %s: no exit %.1fs after SIGTERM; sending SIGKILL", self.rec.shard_id, grace
            )
            procs.signal_group(pgid, signal.SIGKILL)
            await self._wait_exit(10.0)
        # Workers the engine left behind would hold GPU memory: give them a moment, then kill.
        for _ in range(20):
            if not procs.group_alive(pgid):
                break
            await asyncio.sleep(0.1)
        else:
            procs.signal_group(pgid, signal.SIGKILL)
        return self.exit_code()[1]

    async def _wait_exit(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.exit_code()[0]:
                return True
            await asyncio.sleep(0.05)
        return self.exit_code()[0]

    def fail(self, code: int | None, reason: str, cause: str) -> None:
        """The engine is gone or must be: `reason` for people, `cause` a bounded label."""
        pgid = self.rec.pid
        if pgid is not None:
            procs.signal_group(pgid, signal.SIGKILL)  # orphaned workers would pin the GPUs
        self._count_exit(cause)
        self.transition(
            S.FAILED,
            reason=reason,
            exit_code=code,
            output_tail=tail(self.rec.log_path, self._timing.tail_lines),
            stopping=False,
        )
