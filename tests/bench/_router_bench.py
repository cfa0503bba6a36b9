"""Shared pieces of the router benchmarks: processes, wrk runs, parsing."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from llmgw.dev.servers import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
LLMGW = str(Path(PY).parent / "llmgw")

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","stream":true,"max_tokens":16,"messages":[{"role":"user","content":"Say hello to the benchmark, please."}]}'
"""


# These figures are for the router's own pipeline; admission is
# measured by its own benchmark, so the router benchmarks switch it off.
NO_ADMISSION = "admission: {enabled: false}\n"


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    assert m, text
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(
    url: str, connections: int, seconds: float, threads: int = 1, headers: dict | None = None
) -> WrkResult:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (apt-get install -y wrk)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_SCRIPT)
        for name, value in (headers or {}).items():
            f.write(f'wrk.headers["{name}"] = "{value}"\n')
    try:
        out = subprocess.run(
            [
                "wrk",
                f"-t{threads}",
                f"-c{connections}",
                f"-d{max(1, round(seconds))}s",
                "--latency",
                "-s",
                f.name,
                url,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    errors = 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        errors += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errors += sum(int(x) for x in m.groups())
    return WrkResult(rps, p50, p99, errors, requests)


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes and all their children (uvicorn
    workers, every thread) have used so far; a process already gone counts nothing."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
    return total


class Proc:
    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None):
        self.name = name
        self.port = port
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        try:
            wait_for_port("127.0.0.1", port, 20, self.proc)
        except Exception:
            self.stop()
            self.log.seek(0)
            sys.stderr.write(self.log.read().decode(errors="replace")[-3000:])
            raise

    @property
    def pids(self) -> list[int]:
        """The process and its children (uvicorn workers)."""
        try:
            import psutil

            p = psutil.Process(self.proc.pid)
            return [p.pid] + [c.pid for c in p.children(recursive=True)]
        except Exception:
            return [self.proc.pid]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def fast_upstream(gap_ms: float = 0.0) -> Proc:
    port = free_port()
    argv = [PY, "-m", "llmgw.dev.routerkit", "fast", str(port)]
    return Proc("upstream", argv + ([str(gap_ms)] if gap_ms else []), port)


def router(tmp: Path, upstreams: list[int], workers: int = 1, extra: str = "") -> Proc:
    port, admin = free_port(), free_port()
    eps = "\n".join(
        f"  - {{id: e{i}, url: 'http://127.0.0.1:{p}', models: [m]}}"
        for i, p in enumerate(upstreams)
    )
    cfg = tmp / f"router-{port}.yaml"
    cfg.write_text(
        f"listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\nworkers: {workers}\n"
        f"log_level: warning\nmodels:\n  - name: m\nendpoints:\n{eps}\n{extra}"
    )
    p = Proc("router", [LLMGW, "router", "--config", str(cfg)], port)
    wait_for_port("127.0.0.1", admin, 20, p.proc)
    p.admin = admin  # type: ignore[attr-defined]
    time.sleep(0.5)  # first scrapes land
    return p


def nginx(tmp: Path, upstream: int) -> Proc | None:
    binary = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if binary is None:
        return None
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(
        f"""
worker_processes 2;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  upstream up {{ server 127.0.0.1:{upstream}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""
    )
    return Proc("nginx", [binary, "-c", str(conf), "-p", str(tmp)], port)


def bare_relay(upstream: int, workers: int) -> Proc:
    port = free_port()
    return Proc(
        "bare",
        [
            PY, "-m", "uvicorn", "--factory", "llmgw.dev.routerkit:bare_relay_app",
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
            "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning",
        ],
        port,
        env={"LLMGW_BARE_UPSTREAM": f"http://127.0.0.1:{upstream}"},
    )  # fmt: skip
