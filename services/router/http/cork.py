"""Writes to a client made in one event-loop turn leave in one syscall.

uvicorn writes a response's status line and headers, each body chunk and the
chunked terminator as separate `transport.write` calls, and uvloop sends each
at once: a streamed answer whose events arrive together (the common case for
a short answer, and for every burst of tokens an engine flushes at once) costs
three `send` syscalls and three TCP segments, each waking the client. Profiled
under load, those writes were the router worker's largest single cost.

`CorkedTransport` holds the writes of one loop turn and sends them joined at the
end of it (`call_soon`), like TCP_CORK released every turn: nothing waits on a
timer, so no event is delayed by more than the turn that produced it. Closing
flushes first, so bytes and close keep their order, and so does a response's end:
its bytes leave at once rather than a loop turn later (one client waiting on one
answer sees that turn as latency).
"""

from __future__ import annotations

import asyncio

from llmgw.router.http.httplimits import BoundedHttpToolsProtocol


class CorkedTransport:
    """A transport proxy whose writes within one loop turn go out as one."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def flush(self) -> None:
        held = self._held
        if not held:
            return
        self._held = []
        if self._transport.is_closing():
            return  # the client is gone: uvloop would only count the lost writes
        self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def __getattr__(self, name: str):
        # Everything else (is_closing, pause_reading, get_extra_info, ...) is the
        # transport's own.
        return getattr(self._transport, name)


class CorkedHttpToolsProtocol(BoundedHttpToolsProtocol):
    """The router's HTTP protocol: bounded request heads, corked response writes."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Flow control (FlowControl) keeps the real transport: pausing must not wait a turn.
        self.transport = CorkedTransport(transport, self.loop)  # type: ignore[assignment]

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]
        super().on_response_complete()
