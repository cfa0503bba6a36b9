"""One router process: /readyz says ready only once the public server listens.

uvicorn runs the public app's lifespan (which starts the service) before it binds and
listens, and the admin listener shares the event loop: without this gate, /readyz could
answer 200 while the public port still refused connections."""

from __future__ import annotations

from llmgw.router.http.admin import LocalStats


class Service:
    def readiness(self) -> tuple[bool, str]:
        return True, "ok"


def test_not_ready_until_the_public_server_listens():
    listening = False
    stats = LocalStats(Service(), listening=lambda: listening)
    assert stats.readiness() == (False, "the public port is not listening yet")
    listening = True
    assert stats.readiness() == (True, "ok")


def test_without_a_public_server_to_watch_the_service_decides():
    assert LocalStats(Service()).readiness() == (True, "ok")
