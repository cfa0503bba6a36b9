"""free_port: a port a child can bind a moment later, not one the kernel may give away."""

from __future__ import annotations

import socket

from llmgw.dev import servers as localservers


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low, high = localservers._ephemeral_range()
    ports = [localservers.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)  # two servers started side by side never share one
    assert not [p for p in ports if low <= p <= high]  # outgoing connections cannot take them
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_skipped(monkeypatch):
    busy, idle = localservers.free_port(), localservers.free_port()
    localservers._handed_out.difference_update({busy, idle})
    monkeypatch.setattr(localservers, "_port_band", lambda: [busy, idle])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", busy))
        sock.listen()
        assert localservers.free_port() == idle
        # Both taken now: the kernel's choice, still never one handed out before.
        assert localservers.free_port() not in {busy, idle}
