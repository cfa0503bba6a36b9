"""A bound on request heads: uvicorn's httptools protocol has none.

uvicorn limits headers only with h11 (`h11_max_incomplete_event_size`); with
httptools, which the router uses for speed, a client may send megabytes of
request line and headers and the server keeps collecting them. This protocol
counts the head's bytes and header lines as the parser reports them and, past
MAX_HEAD_BYTES or MAX_HEADERS, answers 431 with an OpenAI-shaped error and
closes the connection before the app ever runs.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmgw.router.http.errors import error_body

MAX_HEAD_BYTES = 32 * 1024  # request line and headers together (nginx's default is 32 KiB)
MAX_HEADERS = 128


class HeadTooLarge(Exception):
    pass


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    _head_bytes = 0
    _too_large: str | None = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        if len(self.headers) >= MAX_HEADERS:
            self._refuse(f"more than {MAX_HEADERS} request headers")
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(f"request line and headers exceed {MAX_HEAD_BYTES} bytes")

    def _refuse(self, message: str) -> None:
        self._too_large = message
        # httptools turns an exception in a callback into HttpParserCallbackError, which
        # uvicorn answers with send_400_response: that is where the 431 goes out.
        raise HeadTooLarge(message)

    def send_400_response(self, msg: str) -> None:
        if self._too_large is None:
            super().send_400_response(msg)
            return
        body = error_body(431, "headers_too_large", self._too_large)
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"x-llmgw-reason: headers_too_large\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body
        )
        self.transport.close()
