"""`llmgw audit replay`: read the log from where it is kept, replay it, print the verdict.

Where the log comes from, in order: `--database-url` (the event archive in
Postgres), `--api URL` (the operator API's /api/events, which reads that same
archive), `--nats URL` (the LLMGW_EVENTS stream itself, as long as retention
kept it); with none given: the operator API if one is configured
(LLMGW_API_URL or a running `llmgw dev`), then LLMGW_DATABASE_URL, then NATS.
The archive outlives stream retention, so it comes first.

Exit status: 0 when every re-derived decision matches the recorded one, 1 when
any differs (with --strict also when a verdict is reworded, or an adapter placement
was decided by another version of its rule and so not re-derived), 3 when the log could
not be read (2 is argparse's usage error).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable

import msgspec

from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.opcli import apiclient
from llmgw.reconciler.audit import replay

Events = list[tuple[int, c.Message]]
PAGE = 1000


class SourceError(RuntimeError):
    pass


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from-seq", type=int, default=0, help="check decisions from this seq")
    parser.add_argument("--to-seq", type=int, default=None, help="stop after this seq")
    parser.add_argument(
        "--explain", type=int, metavar="SEQ", help="show the inputs of the decision at SEQ"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="a verdict reworded, or an adapter placement of another policy version, fails",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print every decision, not only differences"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--database-url", help="read the event archive from PostgreSQL")
    where.add_argument("--api", metavar="URL", help="read the archive through the operator API")
    where.add_argument("--nats", metavar="URL", help="read the LLMGW_EVENTS stream")
    apiclient.add_token_argument(parser)  # /api/events needs a `read` token
    apiclient.add_api_tls_arguments(parser)


def run(args: argparse.Namespace) -> int:
    to_seq = args.explain if args.explain is not None else args.to_seq
    bar = Progress() if sys.stderr.isatty() else None
    try:
        label, reader = choose_source(args)
        events = asyncio.run(reader(to_seq, bar))
    except (SourceError, apiclient.ApiError) as exc:
        print(f"llmgw audit replay: {exc}", file=sys.stderr)
        return 3
    finally:
        if bar is not None:
            bar.close()
    if args.explain is not None:
        try:
            inputs = replay.inputs_at(events, args.explain)
        except LookupError as exc:
            print(f"llmgw audit replay: {exc}", file=sys.stderr)
            return 1
        print("\n".join(replay.render_inputs(inputs)))
        return 0
    bar = Progress("replaying") if sys.stderr.isatty() and len(events) > 1000 else None
    try:
        result = replay.replay(
            events,
            from_seq=args.from_seq,
            to_seq=args.to_seq,
            progress=(lambda seq: bar.update(seq, events[-1][0])) if bar else None,
        )
    finally:
        if bar is not None:
            bar.close()
    print(f"log read from {label}")
    print("\n".join(replay.render(result, strict=args.strict, verbose=args.verbose)))
    return 1 if result.differing(args.strict) else 0


Reader = Callable[..., Awaitable[Events]]


def choose_source(args: argparse.Namespace) -> tuple[str, Reader]:
    if args.database_url:
        return "the event archive (PostgreSQL)", _db_reader(args.database_url)
    if args.api:
        return f"the operator API at {args.api}", _api_reader(args.api.rstrip("/"), args)
    if args.nats:
        return f"the {s.EVENTS_STREAM} stream", _nats_reader(args.nats)
    try:
        api = apiclient.find_api_url(None)
        return f"the operator API at {api}", _api_reader(api, args)
    except apiclient.ApiError:
        pass
    if os.environ.get("LLMGW_DATABASE_URL"):
        return "the event archive (PostgreSQL)", _db_reader(os.environ["LLMGW_DATABASE_URL"])
    url = apiclient.find_nats_url(None)
    return f"the {s.EVENTS_STREAM} stream at {url}", _nats_reader(url)


def _decode(seq: int, raw: bytes, skipped: list[int]) -> c.Message | None:
    try:
        return c.decode(raw)
    except c.ContractError:
        skipped.append(seq)  # the fold dead-lettered it too: it never changed the state
        return None


def _collect(rows, skipped: list[int]) -> Events:
    out: Events = []
    for seq, raw in rows:
        ev = _decode(seq, raw, skipped)
        if ev is not None:
            out.append((seq, ev))
    return out


def _api_reader(base: str, args: argparse.Namespace) -> Reader:
    token, tls = args.token, apiclient.api_tls_flags(args)

    async def read(to_seq: int | None, bar: Progress | None) -> Events:
        out: Events = []
        skipped: list[int] = []
        seq = 1
        while to_seq is None or seq <= to_seq:
            params = {"from_seq": seq, "limit": PAGE}
            if to_seq is not None:
                params["to_seq"] = to_seq
            page = await asyncio.to_thread(
                apiclient.get_json, base, "/api/events", params, token, tls
            )
            if not page:
                break
            rows = [(item["seq"], msgspec.json.encode(item["event"])) for item in page]
            out += _collect(rows, skipped)
            seq = rows[-1][0] + 1
            if bar is not None:
                bar.update(seq - 1, to_seq)
        return out

    return read


def _db_reader(url: str) -> Reader:
    async def read(to_seq: int | None, bar: Progress | None) -> Events:
        from sqlalchemy import select

        from llmgw.reconciler.store import schema
        from llmgw.reconciler.store import tables as t

        engine = schema.make_engine(url, pool_size=1)
        archive = t.ArchivedEvent.__table__
        out: Events = []
        skipped: list[int] = []
        try:
            async with engine.connect() as conn:
                q = select(archive.c.seq, archive.c.payload).order_by(archive.c.seq)
                if to_seq is not None:
                    q = q.where(archive.c.seq <= to_seq)
                result = await conn.stream(q.execution_options(yield_per=PAGE))
                async for part in result.partitions(PAGE):
                    out += _collect([(row.seq, bytes(row.payload)) for row in part], skipped)
                    if bar is not None and out:
                        bar.update(out[-1][0], to_seq)
        except Exception as exc:
            raise SourceError(f"cannot read the event archive: {exc}") from None
        finally:
            await engine.dispose()
        return out

    return read


def _nats_reader(url: str) -> Reader:
    async def read(to_seq: int | None, bar: Progress | None) -> Events:
        from llmgw import bus

        try:
            options = apiclient.nats_options(url)
            nc = await bus.connect(
                url, name="llmgw-audit-replay", wait_for_server=False, connect_timeout=3, **options
            )
        except Exception as exc:
            raise SourceError(f"cannot connect to NATS at {url}: {exc}") from None
        out: Events = []
        skipped: list[int] = []
        try:
            js = nc.jetstream()
            info = await js.stream_info(s.EVENTS_STREAM)
            last = info.state.last_seq if to_seq is None else min(to_seq, info.state.last_seq)
            if info.state.first_seq > 1:
                print(
                    f"warning: the stream starts at seq {info.state.first_seq} (retention): "
                    "read the archive (--api or --database-url) for a full replay",
                    file=sys.stderr,
                )
            if info.state.messages == 0 or last < info.state.first_seq:
                return out
            async for msg in bus.read_range(js, s.EVENTS_ALL, info.state.first_seq, last):
                seq = msg.metadata.sequence.stream
                ev = _decode(seq, msg.data, skipped)
                if ev is not None:
                    out.append((seq, ev))
                if bar is not None and seq % 500 == 0:
                    bar.update(seq, last)
        except TimeoutError:
            raise SourceError(f"the {s.EVENTS_STREAM} stream stopped answering") from None
        except SourceError:
            raise
        except Exception as exc:
            raise SourceError(f"cannot read {s.EVENTS_STREAM}: {exc}") from None
        finally:
            await nc.close()
        return out

    return read


class Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, label: str = "reading log"):
        self.label = label
        self._last = 0.0
        self._drawn = False

    def update(self, seq: int, total: int | None) -> None:
        now = time.monotonic()
        if now - self._last < 0.1:
            return
        self._last = now
        if total:
            frac = min(1.0, seq / total)
            bar = "#" * int(frac * 30)
            text = f"\r{self.label}: seq {seq}/{total} [{bar:<30}] {frac:4.0%}"
        else:
            text = f"\r{self.label}: seq {seq}"
        sys.stderr.write(text)
        sys.stderr.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
