"""A TCP proxy that can freeze: stop forwarding in both directions without closing anything.

What a partition, a stuck NAT entry or a hung middlebox looks like to both
ends: every socket stays open and healthy at the TCP level (this process's
kernel keeps acknowledging), but no byte gets through. A closed socket would
be noticed at once; this is not.
"""

from __future__ import annotations

import asyncio
import contextlib


class FreezableProxy:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.frozen = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def freeze(self) -> None:
        self.frozen = True

    async def _hang(self) -> None:
        await asyncio.Event().wait()  # until the proxy is closed

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        me = asyncio.current_task()
        assert me is not None
        self._tasks.add(me)
        try:
            await self._connect(reader, writer)
        except asyncio.CancelledError:
            pass  # the proxy closed: a handler asyncio owns must not end "cancelled"
        finally:
            self._tasks.discard(me)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.frozen:
            await self._hang()  # accepted by the kernel, never answered
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.append(up_writer)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(65536)
                if self.frozen:
                    await self._hang()  # dropped, and nothing more is read: no EOF either
                if not data:
                    dst.close()
                    return
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            dst.close()

    async def close(self) -> None:
        """Cut every connection (as the end of a partition would, eventually)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for writer in self._writers:
            with contextlib.suppress(Exception):
                writer.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)
