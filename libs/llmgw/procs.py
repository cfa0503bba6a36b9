"""Child processes with prefixed log lines and a clean, bounded stop.

Used by `llmgw dev` and the end-to-end tests: each child runs in its own
process group, its output is copied line by line with a `[name]` prefix to a
sink (stdout, or a file), and `stop()` sends SIGTERM, waits up to a grace
period, then SIGKILLs what is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TextIO


class Child:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        sink: Callable[[str], None] | None = None,
        tail_lines: int = 200,
    ):
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.cwd = cwd
        self.sink = sink
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> Child:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.env:
            env.update(self.env)
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.cwd,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._pump, name=f"log-{self.name}", daemon=True)
        self._reader.start()
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            if self.sink:
                self.sink(f"[{self.name}] {line}")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)  # type: ignore[union-attr]

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc:
            self.proc.wait(10)

    def stop(self, grace: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.running():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(5)
        if self._reader:
            self._reader.join(2)
        return self.proc.returncode

    def output(self) -> str:
        return "\n".join(self.tail)


class Group:
    """Children stopped in reverse start order."""

    def __init__(self, sink: Callable[[str], None] | None = None):
        self.children: dict[str, Child] = {}
        self.sink = sink

    def start(self, name: str, argv: Sequence[str], **kwargs) -> Child:
        kwargs.setdefault("sink", self.sink)
        child = Child(name, argv, **kwargs).start()
        self.children[name] = child
        return child

    def stop(self, grace: float = 10.0) -> None:
        for child in reversed(list(self.children.values())):
            child.stop(grace)

    def exited(self) -> list[Child]:
        return [
            c for c in self.children.values() if c.proc is not None and c.proc.poll() is not None
        ]


def printer(stream: TextIO = sys.stdout) -> Callable[[str], None]:
    lock = threading.Lock()

    def _print(line: str) -> None:
        with lock:
            stream.write(line + "\n")
            stream.flush()

    return _print


def llmgw_argv(*args: str) -> list[str]:
    """argv running this installation's llmgw CLI, independent of PATH."""
    return [sys.executable, "-m", "llmgw.cli", *args]


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
