"""The agent's configuration: defaults < YAML file < LLMGW_* environment < CLI flags."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgspec

from llmgw import bus, config, subjects, tlsconfig
from llmgw.engines import ENGINES

ADMIN_PORT = 9410


class AgentConfig(config.ConfigStruct, kw_only=True):
    node_id: str = ""  # "" -> the host name, made subject-safe
    nats: str = "nats://127.0.0.1:4222"  # comma-separated for a cluster
    # Mutual TLS with the certificate of identity agent-<node> (llmgw certs / nats-config).
    nats_tls: tlsconfig.NatsTLS = msgspec.field(default_factory=tlsconfig.NatsTLS)
    # /metrics, /healthz, /readyz; "" turns the listener off.
    admin_listen: str = f"127.0.0.1:{ADMIN_PORT}"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    # Inventory for simulated nodes, e.g. "8x80GiB" or "2x80GiB:H100,2x40GiB" (see inventory.py).
    fake_gpus: str = ""
    engine_port_range: str = "8100-8199"
    state_dir: str = ""  # "" -> $XDG_STATE_HOME/llmgw/agent-<node>
    # The address routers reach this node's engines at; it goes into every engine URL.
    advertise_address: str = "127.0.0.1"
    engine_bind_host: str = ""  # "" -> advertise_address
    heartbeat_interval_seconds: float = 2.0
    load_interval_seconds: float = 0.25
    # Relay vLLM / SGLang / simulator KV cache events to routers (adds --kv-events-config).
    kv_events: bool = True
    ready_timeout_seconds: float = 1800.0  # large models load for many minutes
    ready_poll_seconds: float = 0.25
    # Non-HTTP shards (vLLM --headless ranks) count as ready once alive this long.
    headless_settle_seconds: float = 5.0
    # A draining engine with no requests stops only after this long in draining, so
    # routers have seen the state before the engine goes away.
    drain_settle_seconds: float = 1.0
    output_tail_lines: int = 40
    # LoRA adapter loads and unloads: calls per adapter before a failure is final, the
    # first backoff between them (doubled each time), and one call's deadline.
    adapter_attempts: int = 4
    adapter_backoff_seconds: float = 0.5
    adapter_call_timeout_seconds: float = 120.0
    vllm_command: list[str] = msgspec.field(default_factory=lambda: _default_command("vllm"))
    sglang_command: list[str] = msgspec.field(default_factory=lambda: _default_command("sglang"))
    sim_command: list[str] = msgspec.field(default_factory=lambda: _default_command("sim"))
    log_level: str = "info"
    bus: bus.BusConfig = msgspec.field(default_factory=bus.BusConfig)

    def engine_commands(self) -> dict[str, list[str]]:
        """Each engine's executable prefix, by engine name (one setting per engine)."""
        return {"vllm": self.vllm_command, "sglang": self.sglang_command, "sim": self.sim_command}


def _default_command(engine: str) -> list[str]:
    return list(ENGINES[engine].default_command)


def resolve_node_id(cfg: AgentConfig) -> str:
    node = cfg.node_id or subjects.safe_token(socket.gethostname().split(".")[0])
    try:
        return subjects.token(node, "node id")
    except subjects.SubjectError as exc:
        raise config.ConfigError(f"node_id: {exc}") from None


def parse_port_range(value: str) -> range:
    """'8100-8199' -> range(8100, 8200); a single port is a range of one."""
    lo, sep, hi = value.strip().partition("-")
    try:
        first = int(lo)
        last = int(hi) if sep else first
    except ValueError:
        raise config.ConfigError(
            f"engine_port_range = {value!r}: expected FIRST-LAST, e.g. 8100-8199"
        ) from None
    if not (1 <= first <= last <= 65535):
        raise config.ConfigError(
            f"engine_port_range = {value!r}: ports must satisfy 1 <= FIRST <= LAST <= 65535"
        )
    return range(first, last + 1)


def parse_labels(value: str) -> dict[str, str]:
    """'fabric=ib-a,zone=z1' -> {'fabric': 'ib-a', 'zone': 'z1'}."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise config.ConfigError(f"labels: {part!r} is not KEY=VALUE")
        out[key.strip()] = val.strip()
    return out


def resolve_state_dir(cfg: AgentConfig, node: str) -> Path:
    if cfg.state_dir:
        return Path(cfg.state_dir)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "llmgw" / f"agent-{node}"
