"""Chaos on a local cluster under OpenAI SDK traffic: what a real fleet's faults cost.

Run: .venv/bin/python tests/bench/chaos_cluster.py   (about 5-10 minutes; Linux)

Starts the cluster `llmgw dev` runs, with a three-node NATS cluster, then keeps
OpenAI clients (no SDK retries, so nothing hides a failure) busy on both routers
through each fault in turn:

  1. kill -9 of the leader reconciler (restarted afterwards as a standby);
  2. the leader frozen (SIGSTOP) past the lock's session timeout, then resumed: it
     must step down, not act on its stale term;
  3. kill -9 of an agent, restarted later: its node recovers without orphan engines;
  4. kill -9 of one engine: the agent reports it, the replica is replaced;
  5. kill -9 of one NATS node of three, restarted;
  6. a wall-clock step of +10 minutes, then back, on the leader (libfaketime, wall
     clock only: CLOCK_MONOTONIC does not move, as under an NTP step);
  7. the leader's path to Postgres frozen (a TCP proxy that stops forwarding without
     closing anything), then thawed.

Then it checks what an operator would: `llmgw audit verify`; every event sequence of
the stream archived or dead-lettered exactly once (none lost, none doubled); and the
engines actually running per model against what the catalog asks for.

Fault 6 needs Debian's `faketime` package (libfaketime); without it, it is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e import clusterkit as ck  # noqa: E402

ENV = {
    "LLMGW_ACTOR__UNREACHABLE_AFTER": "3",
    "LLMGW_ACTOR__LOST_AFTER": "8",
}
FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
MODEL = "demo-chat"


class FreezableProxy:
    """A loopback TCP proxy that can stop forwarding without closing a socket: to the
    processes on both sides the path is simply silent, as behind a dead router."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.frozen = threading.Event()
        self._stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.5)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._stop.is_set():
                if self.frozen.is_set():
                    time.sleep(0.05)
                    continue
                ready, _, _ = select.select(list(peers), [], [], 0.2)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    peers[s].sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


def engines_running() -> dict[str, int]:
    """Live sim-engine processes by served model name, read from the process table."""
    counts: dict[str, int] = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "sim-engine" in cmd and "--served-model-name" in cmd:
            name = cmd[cmd.index("--served-model-name") + 1]
            counts[name] = counts.get(name, 0) + 1
    return counts


def engine_pids(model: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline", "pid"]):
        cmd = p.info["cmdline"] or []
        if "sim-engine" in cmd and model in cmd:
            out.append(p.info["pid"])
    return out


def leader_name(cluster) -> str:
    leader = ck.wait(lambda: ck.leader_api(cluster), 60, "a leader")
    return f"reconciler-{cluster.info['api_urls'].index(leader) + 1}"


def set_leader_api(cluster, name: str) -> None:
    cluster.info["api_url"] = cluster.info["api_urls"][int(name.rsplit("-", 1)[1]) - 1]


def wait_leader_is(cluster, name: str, timeout: float = 60) -> None:
    ck.wait(lambda: leader_name(cluster) == name, timeout, f"{name} to lead")
    set_leader_api(cluster, name)


async def events_accounted(cluster) -> tuple[int, int, int, int]:
    """(stream messages, archived, dead-lettered, sequences missing or doubled)."""
    nc = await nats.connect(servers=cluster.info["nats_url"].split(","))
    try:
        info = await nc.jetstream().stream_info("LLMGW_EVENTS")
    finally:
        await nc.close()
    url = cluster.info["database_url"].replace("postgresql+asyncpg", "postgresql")
    conn = await asyncpg.connect(url)
    try:
        archived = [r[0] for r in await conn.fetch("select seq from event_archive")]
        dead = [r[0] for r in await conn.fetch("select seq from dead_letters")]
        pos = await conn.fetchval("select max(last_seq) from consumer_positions")
    finally:
        await conn.close()
    first, last = info.state.first_seq, min(info.state.last_seq, pos or 0)
    seen: dict[int, int] = {}
    for seq in archived + dead:
        seen[seq] = seen.get(seq, 0) + 1
    wrong = sum(1 for s in range(first, last + 1) if seen.get(s, 0) != 1)
    return info.state.messages, len(archived), len(dead), wrong


def main() -> int:
    rows: list[tuple[str, str, str]] = []
    failed_total = 0
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ck.start_cluster(Path(tmp) / "c", env=ENV, nats_cluster=3)
        proxy = None
        try:
            group = cluster.group.children
            clock_file = Path(tmp) / "clock"
            clock_file.write_text("+0\n")

            def under_traffic(name: str, fault) -> None:
                nonlocal failed_total
                with ck.Traffic(
                    cluster.info["routers"], cluster.info["api_key"], MODEL, concurrency=6
                ) as traffic:
                    time.sleep(2)
                    note = fault() or ""
                    time.sleep(3)
                failed_total += len(traffic.failures)
                verdict = "PASS" if not traffic.failures else "FAIL"
                rows.append((name, f"{traffic.ok} ok / {len(traffic.failures)} failed", verdict))
                print(
                    f"== {name}: {traffic.ok} ok / {len(traffic.failures)} failed {note}",
                    flush=True,
                )
                if note:
                    rows.append(("  " + note, "", ""))
                for f in traffic.failures[:3]:
                    print("   ", name, ":", f)

            # Restart reconciler-2 behind a freezable Postgres path (and, where libfaketime
            # is installed, with a wall clock the script can step), then make it leader.
            pg = urlsplit(cluster.info["database_url"])
            proxy = FreezableProxy((pg.hostname or "127.0.0.1", pg.port or 5432))
            via_proxy = urlunsplit(pg._replace(netloc=f"{pg.username}@127.0.0.1:{proxy.port}"))
            r2 = group["reconciler-2"]
            r2.stop()
            r2.argv = [via_proxy if a == cluster.info["database_url"] else a for a in r2.argv]
            has_faketime = Path(FAKETIME).exists()
            if has_faketime:
                r2.env = {
                    **(r2.env or {}),
                    "LD_PRELOAD": FAKETIME,
                    "FAKETIME_TIMESTAMP_FILE": str(clock_file),
                    "FAKETIME_CACHE_DURATION": "1",
                    "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                }
            r2.start()
            if leader_name(cluster) != "reconciler-2":
                group["reconciler-1"].kill9()
                wait_leader_is(cluster, "reconciler-2")
                group["reconciler-1"].start()

            def kill_leader():
                group["reconciler-2"].kill9()
                wait_leader_is(cluster, "reconciler-1")
                group["reconciler-2"].start()
                # Back to reconciler-2 leading, for the faults that need its proxy/clock.
                group["reconciler-1"].kill9()
                wait_leader_is(cluster, "reconciler-2")
                group["reconciler-1"].start()
                return "failover to the standby and back"

            def freeze_leader():
                group["reconciler-2"].signal(signal.SIGSTOP)
                try:
                    wait_leader_is(cluster, "reconciler-1", 90)
                finally:
                    group["reconciler-2"].signal(signal.SIGCONT)
                ck.wait(
                    lambda: leader_name(cluster) == "reconciler-1",
                    30,
                    "the old leader to stay down",
                )
                group["reconciler-1"].kill9()
                wait_leader_is(cluster, "reconciler-2")
                group["reconciler-1"].start()
                return "a frozen leader resumed as a standby"

            def kill_agent():
                group["agent-2"].kill9()
                time.sleep(12)  # past lost_after: the node is lost, its replicas move
                group["agent-2"].start()
                return "agent-2 lost, then back"

            def kill_engine():
                pids = engine_pids(MODEL)
                os.kill(pids[0], signal.SIGKILL)
                return f"engine pid {pids[0]} killed"

            def kill_nats_node():
                cluster.nats.kill(1)
                time.sleep(4)
                cluster.nats.restart(1)
                return "n2 of 3 killed and restarted"

            def step_clock():
                clock_file.write_text("+600\n")
                time.sleep(10)
                clock_file.write_text("+0\n")
                time.sleep(5)
                lost = [
                    n["node"]
                    for n in ck._list(ck.api(cluster, "/api/nodes"))
                    if n.get("state") != "ready"
                ]
                return f"+600 s and back; nodes not ready after it: {lost or 'none'}"

            def freeze_pg_path():
                proxy.frozen.set()
                try:
                    wait_leader_is(cluster, "reconciler-1", 90)
                finally:
                    proxy.frozen.clear()
                return "the leader cut off from Postgres stepped down; the standby took over"

            faults = [
                ("leader reconciler kill -9", kill_leader),
                ("leader frozen (SIGSTOP) and resumed", freeze_leader),
                ("agent kill -9, back later", kill_agent),
                ("engine kill -9", kill_engine),
                ("NATS node kill -9 (1 of 3)", kill_nats_node),
            ]
            if has_faketime:
                faults.append(("wall-clock step on the leader", step_clock))
            else:
                rows.append(("wall-clock step", "skipped: no libfaketime", ""))
            faults.append(("leader's Postgres path frozen", freeze_pg_path))
            for name, fault in faults:
                under_traffic(name, fault)

            # Let the fleet settle, then audit.
            settled = ck.wait(
                lambda: (
                    engines_running().get(MODEL) == 2 and engines_running().get("demo-small") == 1
                ),
                120,
                "the fleet to settle at the catalog's replicas",
                interval=1,
            )
            res = ck.cli(cluster, "audit", "verify", "--database-url", cluster.info["database_url"])
            rows.append(
                (
                    "llmgw audit verify",
                    f"exit {res.returncode}",
                    "PASS" if res.returncode == 0 else "FAIL",
                )
            )
            if res.returncode:
                print(res.stdout[-2000:], res.stderr[-2000:])
            messages, archived, dead, wrong = asyncio.run(events_accounted(cluster))
            rows.append(
                (
                    "events: stream / archived / dead-lettered",
                    f"{messages} / {archived} / {dead}",
                    "",
                )
            )
            rows.append(("events lost or doubled", str(wrong), "PASS" if not wrong else "FAIL"))
            running = engines_running()
            wrongly = abs(running.get(MODEL, 0) - 2) + abs(running.get("demo-small", 0) - 1)
            rows.append(
                (
                    "engines running vs catalog (demo-chat 2, demo-small 1)",
                    f"{running}",
                    "PASS" if settled and not wrongly else "FAIL",
                )
            )
            failed_total += wrong + wrongly + (res.returncode != 0)
        finally:
            if proxy is not None:
                proxy.close()
            with contextlib.suppress(Exception):
                cluster.stop()
    width = max(len(r[0]) for r in rows)
    print()
    for name, value, verdict in rows:
        print(f"{name.ljust(width)}  {value:>24}  {verdict}")
    print("\nPASS" if not failed_total else "\nFAIL")
    return 0 if not failed_total else 1


if __name__ == "__main__":
    sys.exit(main())
