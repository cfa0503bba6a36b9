"""With --workers N the parent's /readyz says ready only once a worker both knows
a ready endpoint and the public port accepts connections (uvicorn's workers call
listen() after their lifespan has already reported in)."""

from __future__ import annotations

import os
import socket
import time

from llmgw.router.http import snapshots
from llmgw.router.http.admin import MergedStats


def write_ready_snapshot(directory):
    snap = snapshots.Snapshot(
        pid=os.getpid(), written_at=time.time(), ready=True, metrics={}, endpoints=[]
    )
    snapshots.Writer(directory, lambda: snap).flush()


def test_not_ready_while_the_public_port_refuses_connections(tmp_path):
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))  # bound, as uvicorn's supervisor leaves it, but not listening
    try:
        port = bound.getsockname()[1]
        write_ready_snapshot(tmp_path)
        stats = MergedStats(tmp_path, workers=2, public=("127.0.0.1", port))
        ready, reason = stats.readiness()
        assert not ready and "public port" in reason
        bound.listen()
        ready, reason = stats.readiness()
        assert ready and reason == "1 of 2 workers ready"
    finally:
        bound.close()


def test_a_wildcard_listen_address_is_probed_on_loopback(tmp_path):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        write_ready_snapshot(tmp_path)
        stats = MergedStats(tmp_path, workers=1, public=("0.0.0.0", listening.getsockname()[1]))
        assert stats.readiness()[0]


def test_no_snapshot_means_not_ready_whatever_the_port(tmp_path):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        stats = MergedStats(tmp_path, workers=2, public=("127.0.0.1", listening.getsockname()[1]))
        assert stats.readiness() == (False, "no worker has reported yet")


def test_debug_endpoints_sums_the_workers_in_flight_and_prefilling(tmp_path):
    # Each worker balances only its own requests; the parent shows their sum.
    def worker(pid, inflight, prefilling):
        ep = {"id": "e1", "inflight": inflight, "prefilling": prefilling, "load_age_s": None}
        ep["circuit"] = {"state": "closed"}
        snap = snapshots.Snapshot(
            pid=pid, written_at=time.time(), ready=True, metrics={}, endpoints=[ep]
        )
        snapshots.Writer(tmp_path, lambda: snap).flush()

    worker(os.getpid(), inflight=3, prefilling=1)
    worker(os.getppid(), inflight=2, prefilling=2)  # another live process
    [merged] = MergedStats(tmp_path, workers=2).endpoints()["endpoints"]
    assert (merged["inflight"], merged["prefilling"]) == (5, 3)
    assert sorted(w["prefilling"] for w in merged["per_worker"]) == [1, 2]
