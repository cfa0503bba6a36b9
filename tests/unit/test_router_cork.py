"""The corked transport: one loop turn's writes reach the socket as one, in order."""

from __future__ import annotations

import asyncio

from llmgw.router.http.cork import CorkedTransport


class _Socket:
    """Records what reaches the real transport."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.events.append("write")

    def close(self) -> None:
        self.closing = True
        self.events.append("close")

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str):
        return ("127.0.0.1", 1) if name == "peername" else None


async def _turn() -> None:
    await asyncio.sleep(0)


def test_one_turns_writes_leave_joined_after_the_turn():
    async def run():
        sock = _Socket()
        t = CorkedTransport(sock, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"5\r\nhello\r\n")
        t.write(b"0\r\n\r\n")
        assert sock.writes == []  # held until the turn ends
        await _turn()
        assert sock.writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n0\r\n\r\n"]
        t.write(b"next")
        await _turn()
        assert sock.writes[1:] == [b"next"]  # a later turn is a later write

    asyncio.run(run())


def test_close_sends_what_is_held_first():
    async def run():
        sock = _Socket()
        t = CorkedTransport(sock, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"last words")
        t.close()
        await _turn()
        assert sock.events == ["write", "close"]
        assert sock.writes == [b"last words"]

    asyncio.run(run())


def test_writes_for_a_client_that_left_are_dropped_and_the_rest_delegates():
    async def run():
        sock = _Socket()
        t = CorkedTransport(sock, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"too late")
        sock.closing = True
        await _turn()
        assert sock.writes == []
        assert t.is_closing() and t.get_extra_info("peername") == ("127.0.0.1", 1)

    asyncio.run(run())
