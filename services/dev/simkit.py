"""Starting simulators from tests (this project's and any other service's).

Two ways, both stopping what they start even when the test fails:

    from llmgw.dev.simkit import start_sim, sim_in_process

    with start_sim(max_num_seqs=4, itl_ms=5) as sim:      # a real `llmgw sim-engine` process
        httpx.get(f"{sim.url}/v1/models"); sim.state(); sim.set_faults(error_rate=1)

    async with sim_in_process(itl_ms=5) as sim:            # same app, in this event loop
        sim.app.engine.snapshot()

Keyword options are SimConfig keys (fault keys too: error_rate=1 becomes --error-rate 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from llmgw.simengine.app import SimApp
from llmgw.simengine.config import FaultConfig, SimConfig, validate
from llmgw.simengine.server import READY_PREFIX, serve


def _flags(options: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list | tuple):
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


@dataclass
class SimProcess:
    """A `llmgw sim-engine` child process."""

    proc: subprocess.Popen
    port: int
    url: str = ""
    stderr_path: str = ""
    _stderr_file: Any = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        """For the openai SDK: `OpenAI(base_url=sim.base_url, api_key="x")`."""
        return f"{self.url}/v1"

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/sim/state", timeout=5).raise_for_status().json()

    def set_faults(self, **faults: Any) -> dict[str, Any]:
        """Replace the fault set (keys of FaultConfig); no arguments clears every fault."""
        return (
            httpx.post(f"{self.url}/sim/faults", json=faults, timeout=5).raise_for_status().json()
        )

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).raise_for_status().text

    def wait_ready(self, timeout: float = 60.0) -> str:
        """Block until the sim prints its ready line; returns its URL."""
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while time.monotonic() < deadline:
                if sel.select(timeout=max(0.0, min(0.1, deadline - time.monotonic()))):
                    line = self.proc.stdout.readline().decode()
                    if line.startswith(READY_PREFIX):
                        self.url = line[len(READY_PREFIX) :].strip()
                        self.port = int(self.url.rsplit(":", 1)[1])
                        return self.url
                    if not line and self.proc.poll() is not None:
                        break
                elif self.proc.poll() is not None:
                    break
        finally:
            sel.close()
        self.stop()
        raise RuntimeError(f"sim-engine did not become ready: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.stderr_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def signal(self, sig: int = signal.SIGTERM) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, SIGKILL if need be; returns the exit status."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._stderr_file is not None:
            self._stderr_file.close()
            self._stderr_file = None
            with contextlib.suppress(OSError):
                os.unlink(self.stderr_path)
        return self.proc.returncode

    def __enter__(self) -> SimProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_sim(
    *args: str,
    port: int = 0,
    wait: bool = True,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    wrapper: Sequence[str] = (),
    **options: Any,
) -> SimProcess:
    """Start `llmgw sim-engine` on 127.0.0.1 (a free port unless `port` is given).

    With wait=True (default) returns once it listens; otherwise call `wait_ready()`. `args` are
    extra raw flags; `wrapper` prefixes the command (e.g. ["taskset", "-c", "0"]).
    """
    cmd = [
        *wrapper,
        sys.executable,
        "-m",
        "llmgw.cli",
        "sim-engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *_flags(options),
        *args,
    ]
    stderr = tempfile.NamedTemporaryFile("w", prefix="simengine-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    sim = SimProcess(
        proc=proc,
        port=port,
        url=f"http://127.0.0.1:{port}" if port else "",
        stderr_path=stderr.name,
        _stderr_file=stderr,
    )
    if wait:
        sim.wait_ready(timeout)
    return sim


@dataclass
class InProcessSim:
    """A simulator served by uvicorn in the caller's event loop.

    Its state and faults are reached directly (a blocking HTTP call from the same loop would
    deadlock); use an async client for HTTP.
    """

    app: SimApp
    url: str
    exited: asyncio.Event
    """Set when `exit_after_requests` fires (in a process, that would have exited)."""

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def state(self) -> dict[str, Any]:
        return self.app.engine.snapshot()

    def set_faults(self, **faults: Any) -> None:
        self.app.faults.replace(FaultConfig(**faults))


@contextlib.asynccontextmanager
async def sim_in_process(
    cfg: SimConfig | None = None, **options: Any
) -> AsyncIterator[InProcessSim]:
    """Serve a simulator in this event loop on a free port; stops it on exit."""
    if cfg is None:
        faults = {k: options.pop(k) for k in list(options) if k in FaultConfig.__struct_fields__}
        cfg = SimConfig(port=0, drain_seconds=1.0, faults=FaultConfig(**faults), **options)
    cfg = validate(cfg)
    stop = asyncio.Event()
    exited = asyncio.Event()

    def on_exit() -> None:
        exited.set()
        stop.set()

    app = SimApp(cfg, on_exit=on_exit)
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(cfg, app=app, stop=stop, handle_signals=False, on_ready=ready.set_result),
        name="sim-in-process",
    )
    try:
        done, _ = await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            task.cancel()
            raise RuntimeError("in-process sim-engine did not start")
        yield InProcessSim(app=app, url=ready.result(), exited=exited)
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, cfg.drain_seconds + 5)
        except TimeoutError:
            task.cancel()
