"""Helpers for tests on real vLLM processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from llmgw import contracts as c
from llmgw import enginemetrics
from llmgw.agent import launch as agent_launch
from llmgw.dev import catalog as devcatalog
from llmgw.dev.servers import free_port

MODEL = "tiny"
# A random model may pick its end-of-sequence token first and answer nothing; tests that
# count tokens or need content ask vLLM to go on to max_tokens.
NO_EOS = {"ignore_eos": True}


@dataclass
class Engine:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log_path: Path
    argv: list[str]

    def metrics(self) -> dict[str, float]:
        return enginemetrics.gauges(httpx.get(f"{self.url}/metrics", timeout=10).content)

    def running(self) -> float:
        return self.metrics().get("vllm:num_requests_running", -1.0)

    def counter(self, name: str) -> float:
        """A counter's value, all its series together (e.g. vllm:generation_tokens_total)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == name
        )

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 600.0) -> None:
        """Until /health answers 200; stopped and raised with its log's tail if it exits
        or the timeout passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM not healthy within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:  # workers left in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_vllm(
    python: str, model: Path, directory: Path, max_model_len: int = 1024, timeout: float = 600.0
) -> Engine:
    port = free_port()
    profile = {**devcatalog.vllm_profile(str(model)), "max_model_len": max_model_len}
    cmd = c.StartShard(
        key="k",
        node="n",
        shard_id="s",
        model=MODEL,
        replica_id="r",
        profile=c.ServingProfile(**profile),
        gpus=["GPU-0"],
    )
    ctx = agent_launch.LaunchContext(port, [0], "127.0.0.1", devcatalog.vllm_command(python))
    spec = agent_launch.vllm(cmd, ctx)
    env = {**agent_launch.engine_environment(os.environ, spec), **devcatalog.VLLM_CPU_ENV}
    engine = launch(spec.argv, env, directory / "vllm.log", f"http://127.0.0.1:{port}")
    engine.wait_healthy(timeout)
    return engine


def launch(argv: list[str], env: dict[str, str], log_path: Path, url: str) -> Engine:
    """Start an engine in its own process group (stop() takes its workers too), its
    output in `log_path`."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    return Engine(proc, url, log_path, argv)


def report(capsys, line: str) -> None:
    """A figure the run prints whatever pytest captures (the note quotes them)."""
    with capsys.disabled():
        print(f"\n[real_engine] {line}", flush=True)


def wait(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # what we wait for may be down for a while
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


@dataclass
class Outcome:
    started: float
    ended: float
    stream: bool
    error: str | None  # None: answered in full


@dataclass
class Traffic:
    """OpenAI SDK requests (every other one streamed) against routers until stopped, each
    outcome recorded with its times, so a test can tell what was in flight at a fault."""

    routers: list[str]
    api_key: str
    model: str
    concurrency: int = 4
    max_tokens: int = 8
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def failures(self, since: float = 0.0) -> list[Outcome]:
        return [o for o in self.outcomes if o.error and o.ended >= since]

    def ok(self) -> int:
        return sum(1 for o in self.outcomes if o.error is None)

    async def _main(self) -> None:
        # max_retries=0: the SDK must not hide a failure by retrying it.
        clients = [
            openai.AsyncOpenAI(base_url=r, api_key=self.api_key, max_retries=0, timeout=60)
            for r in self.routers
        ]
        await asyncio.gather(
            *(self._worker(i, clients[i % len(clients)]) for i in range(self.concurrency))
        )
        for cl in clients:
            await cl.close()

    async def _worker(self, i: int, client: openai.AsyncOpenAI) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = bool(n % 2)
            t0 = time.monotonic()
            error = None
            try:
                messages = [{"role": "user", "content": f"worker {i} request {n}"}]
                kw = dict(model=self.model, messages=messages, max_tokens=self.max_tokens)
                if stream:
                    # Whole means every token, counted by the engine's closing usage: a
                    # random model's few tokens may decode to no text at all.
                    usage = None
                    async for chunk in await client.chat.completions.create(
                        **kw,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body=NO_EOS,
                    ):
                        usage = chunk.usage or usage
                    if usage is None or usage.completion_tokens != self.max_tokens:
                        raise RuntimeError(f"stream ended short: {usage}")
                else:
                    resp = await client.chat.completions.create(**kw, extra_body=NO_EOS)
                    if resp.usage.completion_tokens != self.max_tokens:
                        raise RuntimeError(f"short answer: {resp.usage}")
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            self.outcomes.append(Outcome(t0, time.monotonic(), stream, error))
            if error:
                await asyncio.sleep(0.05)


def samples_by(url: str, name: str, label: str) -> dict[str, float]:
    """One metric's samples on an engine's /metrics page, summed by one label's value
    (e.g. vllm:prompt_tokens_by_source_total by source); "" for samples without it."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def total(url: str, name: str) -> float:
    """A counter's value on an engine's /metrics page, all its series together."""
    return sum(samples_by(url, name, "").values())
