"""NATS and JetStream plumbing shared by every service.

- `connect()` reconnects forever (nats-py's default gives up after ~2 minutes
  and closes the client for good) with jitter, so a fleet does not reconnect
  in lockstep after a server restart.
- `publish()` always sets `Nats-Msg-Id` to the message id, so a retried
  publish inside the stream's duplicate window is stored once, and retries
  transient failures (a stream leader moving) with the same id until its
  deadline.
- `provision()` creates or updates the streams and KV buckets; it is
  idempotent and safe to run from many processes at once, at every start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoRespondersError, NoServersError
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import BadRequestError, NoStreamResponseError, NotFoundError, ServerError

from llmgw import contracts as c
from llmgw import subjects as s

log = logging.getLogger(__name__)


class BusConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Stream and bucket settings; a section of each service's config."""

    replicas: int = 1  # 3 in a clustered JetStream
    # Event log retention; 0: keep forever. The reconciler archives every folded
    # event in Postgres, so audits outlive whatever the stream keeps.
    events_max_age_seconds: float = 0
    events_max_bytes: int = 0
    duplicate_window_seconds: float = 120
    commands_max_age_seconds: float = 86400
    presence_ttl_seconds: float = 10


async def connect(
    url: str | list[str],
    name: str,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    connect_timeout: float = 5.0,
    wait_for_server: bool = True,
    connect_deadline: float | None = None,
    **options,
) -> NATS:
    """A client that never gives up reconnecting; callbacks must be coroutines."""

    async def error_cb(exc: Exception) -> None:
        log.warning("nats error: %s", exc)

    async def disconnected_cb() -> None:
        log.warning("nats disconnected")
        if on_disconnect:
            await on_disconnect()

    async def reconnected_cb() -> None:
        log.info("nats reconnected")
        if on_reconnect:
            await on_reconnect()

    servers = url if isinstance(url, list) else [u.strip() for u in url.split(",")]
    loop = asyncio.get_running_loop()
    if connect_deadline is None and not wait_for_server:
        # nats-py's first-connect loop can outlive connect_timeout (a TLS mismatch
        # kept it busy for 20 s+): a command that must not wait gets a hard bound.
        connect_deadline = 4 * connect_timeout
    stop_at = None if connect_deadline is None else loop.time() + connect_deadline
    delay = 0.2
    while True:
        try:
            attempt = nats.connect(
                servers=servers,
                name=name,
                # With -1 here nats-py would retry the FIRST connect forever inside
                # connect() (no way to give up, no deadline): try each server twice,
                # let the loop below decide, and reconnect forever once connected.
                max_reconnect_attempts=1,
                reconnect_time_wait=0.5 + random.random(),  # jitter: no fleet-wide lockstep
                allow_reconnect=True,
                connect_timeout=connect_timeout,
                error_cb=error_cb,
                disconnected_cb=disconnected_cb,
                reconnected_cb=reconnected_cb,
                **options,
            )
            if stop_at is None:
                nc = await attempt
            else:
                nc = await asyncio.wait_for(attempt, max(0.1, stop_at - loop.time()))
            nc.options["max_reconnect_attempts"] = -1  # read at each reconnect
            return nc
        except (OSError, NoServersError, TimeoutError) as exc:
            # Services may start before NATS: wait for it unless told not to.
            if not wait_for_server or (stop_at is not None and loop.time() + delay > stop_at):
                raise
            log.warning("nats at %s not reachable (%s); retrying in %.1fs", servers, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0) * (0.75 + random.random() / 2)


TRANSIENT = (NoStreamResponseError, NoRespondersError, asyncio.TimeoutError, TimeoutError)


async def publish(
    js: JetStreamContext,
    msg: c.Message,
    *,
    subject: str | None = None,
    headers: dict[str, str] | None = None,
    deadline: float = 10.0,
) -> jsapi.PubAck:
    """Publish a message to its JetStream subject with dedupe; retry transient errors until `deadline`."""
    subject = subject or s.subject_for(msg)
    hdrs = {"Nats-Msg-Id": msg.id}
    if headers:
        hdrs.update(headers)
    payload = c.encode(msg)
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + deadline
    delay = 0.05
    while True:
        remaining = stop_at - loop.time()
        try:
            return await js.publish(
                subject, payload, headers=hdrs, timeout=max(0.5, min(2.0, remaining))
            )
        except TRANSIENT as exc:
            if loop.time() + delay >= stop_at:
                raise
            log.debug(
                "publish to %s failed (%s); retrying with the same id", subject, type(exc).__name__
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


# nats-server answers 10049 "error creating store for stream" for a create that meets
# the removal of the account's store directory, which it does when the last stream is
# deleted (its log: "mkdir .../$G/streams: no such file or directory"; nats-server
# 2.15.1, about one create in 150 right after such a delete); it passes at once.
STORE_BUSY = 10049
STORE_BUSY_DEADLINE = 5.0


async def _while_store_busy(name: str, create: Callable[[], Awaitable[object]]) -> None:
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + STORE_BUSY_DEADLINE
    while True:
        try:
            await create()
            return
        except ServerError as exc:
            if exc.err_code != STORE_BUSY or loop.time() >= stop_at:
                raise
            log.info("stream %s: store busy (%s); retrying", name, exc.description)
            await asyncio.sleep(0.1)


async def ensure_stream(js: JetStreamContext, cfg: jsapi.StreamConfig) -> None:
    """Create the stream, or bring an existing one up to `cfg`."""
    try:
        await _while_store_busy(cfg.name or "", lambda: js.add_stream(cfg))
    except BadRequestError as exc:
        if exc.err_code == 10058:  # exists with a different config: bring it up to date
            await js.update_stream(cfg)
        else:
            raise


def _window(duplicate_window: float, max_age: float) -> float:
    return min(duplicate_window, max_age) if max_age else duplicate_window


def stream_configs(cfg: BusConfig) -> list[jsapi.StreamConfig]:
    return [
        jsapi.StreamConfig(
            name=s.EVENTS_STREAM,
            subjects=[s.EVENTS_ALL],
            storage=jsapi.StorageType.FILE,
            retention=jsapi.RetentionPolicy.LIMITS,
            max_age=cfg.events_max_age_seconds or None,
            max_bytes=cfg.events_max_bytes or None,
            # -1: an event log must never drop history per subject.
            max_msgs_per_subject=-1,
            # JetStream refuses a window longer than the retention.
            duplicate_window=_window(cfg.duplicate_window_seconds, cfg.events_max_age_seconds),
            num_replicas=cfg.replicas,
            max_msg_size=1024 * 1024,
        ),
        jsapi.StreamConfig(
            name=s.HEARTBEATS_STREAM,
            subjects=[s.HEARTBEATS_ALL],
            storage=jsapi.StorageType.FILE,
            retention=jsapi.RetentionPolicy.LIMITS,
            max_msgs_per_subject=1,  # only the latest per node matters
            num_replicas=cfg.replicas,
            max_msg_size=256 * 1024,
        ),
        jsapi.StreamConfig(
            name=s.COMMANDS_STREAM,
            subjects=[s.COMMANDS_ALL],
            storage=jsapi.StorageType.FILE,
            retention=jsapi.RetentionPolicy.LIMITS,
            max_age=cfg.commands_max_age_seconds,
            duplicate_window=_window(cfg.duplicate_window_seconds, cfg.commands_max_age_seconds),
            num_replicas=cfg.replicas,
            max_msg_size=1024 * 1024,
        ),
    ]


async def _ensure_bucket(
    js: JetStreamContext, bucket: str, cfg: BusConfig, ttl: float | None = None
) -> None:
    try:
        await js.key_value(bucket)
        return
    except (NotFoundError, BadRequestError):
        pass
    except Exception as exc:  # nats-py raises BucketNotFoundError (a NotFoundError) or similar
        if "not found" not in str(exc).lower():
            raise
    kv_cfg = jsapi.KeyValueConfig(
        bucket=bucket, history=1, ttl=ttl, replicas=cfg.replicas, storage=jsapi.StorageType.FILE
    )
    try:
        await _while_store_busy(f"KV_{bucket}", lambda: js.create_key_value(kv_cfg))
    except BadRequestError as exc:
        if exc.err_code != 10058:  # another process created it meanwhile
            raise


async def provision(js: JetStreamContext, cfg: BusConfig | None = None) -> None:
    """Create or update every stream and bucket llmgw uses. Idempotent."""
    cfg = cfg or BusConfig()
    for stream in stream_configs(cfg):
        await ensure_stream(js, stream)
    await _ensure_bucket(js, s.ENDPOINTS_BUCKET, cfg)
    await _ensure_bucket(js, s.TENANTS_BUCKET, cfg)
    await _ensure_bucket(js, s.ROUTERS_BUCKET, cfg, ttl=cfg.presence_ttl_seconds)


async def ensure_pull_consumer(
    js: JetStreamContext,
    stream: str,
    durable: str,
    filter_subject: str | None = None,
    *,
    ack_wait: float = 30.0,
    max_ack_pending: int = 10_000,
    deliver_policy: jsapi.DeliverPolicy = jsapi.DeliverPolicy.ALL,
    ack_policy: jsapi.AckPolicy = jsapi.AckPolicy.EXPLICIT,
    start_seq: int | None = None,
    recreate: bool = False,
) -> JetStreamContext.PullSubscription:
    """Create the durable if missing, then bind to it.

    `pull_subscribe(durable=...)` silently ignores its config when the durable
    exists, so creation and binding are separate steps.

    `start_seq` delivers from that stream sequence on; with `recreate` the
    durable is deleted and made afresh, dropping whatever it had delivered but
    not seen acknowledged. A consumer whose position lives elsewhere (the
    reconciler's, in Postgres) recreates it on every start: stale pending
    messages would otherwise be redelivered after newer ones, out of order.
    """
    if start_seq is not None:
        deliver_policy = jsapi.DeliverPolicy.BY_START_SEQUENCE
    cfg = jsapi.ConsumerConfig(
        # `name` as well as `durable_name`: nats-py then creates through
        # $JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>, the only form the mTLS
        # permissions (llmgw.natsconfig) grant an agent, since the server checks
        # that the body's filter matches the one in the subject.
        name=durable,
        durable_name=durable,
        ack_policy=ack_policy,
        ack_wait=ack_wait,
        max_ack_pending=max_ack_pending,
        deliver_policy=deliver_policy,
        opt_start_seq=start_seq,
        filter_subject=filter_subject,
    )
    if recreate:
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(stream, durable)
        await js.add_consumer(stream, cfg)
        return await js.pull_subscribe_bind(durable=durable, stream=stream)
    try:
        await js.consumer_info(stream, durable)
    except NotFoundError:
        await js.add_consumer(stream, cfg)
    return await js.pull_subscribe_bind(durable=durable, stream=stream)


async def read_range(
    js: JetStreamContext, subject: str, first: int, last: int, *, timeout: float = 5.0
) -> AsyncIterator[Msg]:
    """The stream's messages on `subject` from sequence `first` through `last`, in order,
    through an ordered consumer that is gone after; TimeoutError when the stream stops
    answering for `timeout` seconds."""
    sub = await js.subscribe(
        subject,
        ordered_consumer=True,
        config=jsapi.ConsumerConfig(
            deliver_policy=jsapi.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first
        ),
    )
    try:
        while True:
            msg = await sub.next_msg(timeout=timeout)
            seq = msg.metadata.sequence.stream
            if seq > last:
                return
            yield msg
            if seq >= last:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def close_quietly(nc: NATS | None) -> None:
    if nc is None:
        return
    try:
        await asyncio.wait_for(nc.drain(), timeout=5)
    except (ConnectionClosedError, TimeoutError, Exception):
        try:
            await nc.close()
        except Exception:
            pass
