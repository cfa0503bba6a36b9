"""`llmgw events tail|export`: read the event log.

- `tail` follows LLMGW_EVENTS live over NATS (an ordered consumer: no state
  left on the server), one readable line per event or, with `-o json`, one
  JSON object per line. `--from-seq N` replays from N first, then follows.
- `export --from-seq N [--to-seq M]` writes JSON lines: from the reconciler's
  archive through the operator API (it outlives stream retention), or from
  the stream itself with `--nats`.

Every JSON line has the same shape wherever it came from:
{"seq", "subject", "type", "id", "ts", "event"}; an entry that is not a valid
message has "event": null and an "error".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from typing import Any

import msgspec
from nats.js import api as jsapi

from llmgw import bus, subjects

from . import apiclient

PAGE = 1000
# Fields worth showing on a readable line, in this order.
_SUMMARY_FIELDS = ("node", "name", "model", "replica_id", "shard_id", "state", "reason", "band")


def entry(seq: int, subject: str, data: bytes) -> dict[str, Any]:
    """A log entry as a JSON-ready dict, tolerant of bytes that are not a message."""
    try:
        event = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        return {"seq": seq, "subject": subject, "type": None, "id": None, "ts": None,
                "event": None, "error": f"not JSON: {exc}"}  # fmt: skip
    if not isinstance(event, dict):
        event = {"value": event}
    return {
        "seq": seq,
        "subject": subject,
        "type": event.get("type"),
        "id": event.get("id"),
        "ts": event.get("ts"),
        "event": event,
    }


def readable(e: dict[str, Any]) -> str:
    ts = e.get("ts")
    when = (
        time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
        if isinstance(ts, int | float)
        else "--:--:--.---"
    )
    ev = e.get("event") or {}
    if e.get("error"):
        detail = e["error"]
    else:
        detail = " ".join(
            f"{k}={ev[k]}" for k in _SUMMARY_FIELDS if isinstance(ev.get(k), str) and ev.get(k)
        )
    return f"{e['seq']:>8} {when} {e.get('type') or '?':<28} {detail}"


def _print(e: dict[str, Any], fmt: str) -> None:
    print(json.dumps(e) if fmt == "json" else readable(e), flush=True)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="events_command", metavar="ACTION", required=True)
    tail = sub.add_parser("tail", help="follow the event log live")
    apiclient.add_nats_argument(tail)
    tail.add_argument("--from-seq", type=int, help="replay from this sequence, then follow")
    tail.add_argument("-o", "--output", choices=["text", "json"], default="text")
    export = sub.add_parser("export", help="write a range of events as JSON lines")
    export.add_argument("--from-seq", type=int, default=1)
    export.add_argument("--to-seq", type=int, help="last sequence (default: the end)")
    source = export.add_mutually_exclusive_group()
    apiclient.add_api_argument(source)
    source.add_argument(
        "--nats", metavar="URL", help="read the stream at URL instead of the archive"
    )
    apiclient.add_token_argument(export)
    apiclient.add_api_tls_arguments(export)


async def _connect(url: str):
    try:
        options = apiclient.nats_options(url)
        return await bus.connect(
            url, name="llmgw-events", wait_for_server=False, connect_timeout=3, **options
        )
    except apiclient.ApiError:
        raise
    except Exception as exc:
        raise apiclient.ApiError(f"cannot reach NATS at {url}: {exc}") from None


async def _tail(url: str, from_seq: int | None, fmt: str) -> None:
    nc = await _connect(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        js = nc.jetstream()
        cfg = (
            jsapi.ConsumerConfig(
                deliver_policy=jsapi.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=from_seq
            )
            if from_seq
            else jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.NEW)
        )

        async def on_msg(msg) -> None:
            _print(entry(msg.metadata.sequence.stream, msg.subject, msg.data), fmt)

        sub = await js.subscribe(
            subjects.EVENTS_ALL, cb=on_msg, ordered_consumer=True, config=cfg, idle_heartbeat=2.0
        )
        await stop.wait()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    finally:
        await bus.close_quietly(nc)


async def _export_stream(url: str, from_seq: int, to_seq: int | None) -> None:
    nc = await _connect(url)
    try:
        js = nc.jetstream()
        last = (await js.stream_info(subjects.EVENTS_STREAM)).state.last_seq
        end = last if to_seq is None else min(to_seq, last)
        if from_seq > end:
            return
        async for msg in bus.read_range(js, subjects.EVENTS_ALL, from_seq, end):
            _print(entry(msg.metadata.sequence.stream, msg.subject, msg.data), "json")
    finally:
        await bus.close_quietly(nc)


def _export_api(
    api: str, from_seq: int, to_seq: int | None, token: str | None, tls: apiclient.ApiTLS
) -> None:
    seq = from_seq
    while to_seq is None or seq <= to_seq:
        params: dict[str, Any] = {"from_seq": seq, "limit": PAGE}
        if to_seq is not None:
            params["to_seq"] = to_seq
        page = apiclient.get_json(api, "/api/events", params, token, tls)
        for e in page:
            print(json.dumps(e))
        if len(page) < PAGE:
            return
        seq = page[-1]["seq"] + 1


def run(args: argparse.Namespace) -> int:
    try:
        if args.events_command == "tail":
            asyncio.run(_tail(apiclient.find_nats_url(args.nats), args.from_seq, args.output))
        elif args.nats:
            asyncio.run(_export_stream(args.nats, args.from_seq, args.to_seq))
        else:
            api = apiclient.find_api_url(args.api)
            tls = apiclient.api_tls_flags(args)
            _export_api(api, args.from_seq, args.to_seq, args.token, tls)
    except apiclient.ApiError as exc:
        print(f"llmgw events: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `llmgw events export ... | head`
        return 0
    return 0
