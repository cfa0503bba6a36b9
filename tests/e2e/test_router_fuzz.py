"""Hostile input against a real `llmgw router` process in front of a real sim engine.

Hypothesis sends a few thousand malformed requests (bytes that are not JSON, JSON of
every shape, valid requests with one field replaced by anything, the schema's own
fields from the router's /openapi.json given wrong types and ranges, odd methods,
paths and header bytes) plus the limits themselves (nesting, body and header
sizes). The upstream is up the whole time, so no answer may be a 5xx:
every refusal is a 4xx with an OpenAI-shaped body. Afterwards the router still
serves a good request through the openai SDK, its own metrics count no 5xx, and
its log (debug level, access log on) never contains an API key that was sent.

LLMGW_FUZZ_EXAMPLES sets the number of generated requests (default 3000, about 8 s).
"""

from __future__ import annotations

import json
import os
import re
import socket
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from llmgw import keys
from llmgw.dev.routerkit import start_router
from llmgw.dev.simkit import start_sim
from llmgw.router.request import validation as v

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("LLMGW_FUZZ_EXAMPLES", "3000"))
KEY = keys.new_key()
WRONG_KEY = keys.new_key()  # sent too: a refused key must not be logged either
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BASE = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "m", "prompt": "once upon"},
    "/v1/embeddings": {"model": "m", "input": "hello"},
}


def fuzz_settings(share: float):
    return settings(
        max_examples=max(10, int(EXAMPLES * share)),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---------------------------------------------------------------- a bare HTTP/1.1 client


class Conn:
    """One keep-alive connection that sends whatever bytes it is given and reads one answer
    (content-length, chunked, or until close); reopened whenever the server closed it."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.addr = (host, int(port))
        self.sock: socket.socket | None = None
        self.buf = b""

    def _open(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.create_connection(self.addr, timeout=10)
            self.buf = b""
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None

    def _fill(self) -> None:
        assert self.sock is not None
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("closed by the server")
        self.buf += data

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def send(self, raw: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        for attempt in (1, 2):
            sock = self._open()
            try:
                sock.sendall(raw)
                return self._read(head=raw.startswith(b"HEAD "))
            except (ConnectionError, BrokenPipeError) as exc:
                # The server closes after refusing garbage; a connection it closed while
                # idle (between two requests) is retried once on a fresh one.
                self.close()
                if attempt == 2:
                    raise AssertionError(f"no answer to {raw[:200]!r}: {exc}") from None
        raise AssertionError("unreachable")

    def _read(self, head: bool) -> tuple[int, dict[bytes, bytes], bytes]:
        status_line = self._line()
        status = int(status_line.split()[1])
        headers: dict[bytes, bytes] = {}
        while line := self._line():
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if head:  # the answer to HEAD has the headers of a GET and no body
            body = b""
        elif b"content-length" in headers:
            body = self._take(int(headers[b"content-length"]))
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            parts = []
            while size := int(self._line().split(b";")[0], 16):
                parts.append(self._take(size))
                self._take(2)
            while self._line():  # trailers, then the empty line
                pass
            body = b"".join(parts)
        else:
            body = self.buf
            try:
                while True:
                    self._fill()
            except ConnectionError:
                body = self.buf
            self.close()
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, headers, body


def request(
    method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] | None = None
) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: router"]
    head += [f"{k}: {v}" for k, v in headers or []]
    head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def post(path: str, body: bytes, key: str = KEY) -> bytes:
    return request(
        "POST",
        path,
        body,
        [("Content-Type", "application/json"), ("Authorization", f"Bearer {key}")],
    )


# ---------------------------------------------------------------- the processes


@pytest.fixture(scope="module")
def sim():
    engine = start_sim(model="m", itl_ms=0, ttft_ms=0, max_model_len=512, default_output_tokens=4)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def router(sim, tmp_path_factory):
    r = start_router(
        tmp_path_factory.mktemp("fuzz"),
        "log_level: debug\n"
        "access_log: true\n"
        "max_body_bytes: 1048576\n"
        "admission: {enabled: false}\n"
        "bands: [{name: std, ceiling: 2.0}]\n"
        f"tenants: [{{name: t, band: std, key_hashes: ['{keys.hash_key(KEY)}']}}]\n"
        "models: [{name: m, aliases: [m-latest]}]\n"
        f"endpoints: [{{id: s0, url: '{sim.url}', models: [m], engine: sim}}]\n",
    )
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def conn(router):
    c = Conn(router.url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def schema(router) -> dict[str, Any]:
    return httpx.get(router.url + "/openapi.json", timeout=5).json()


def check(answer: tuple[int, dict[bytes, bytes], bytes], what: Any) -> int:
    status, headers, body = answer
    assert status < 500, f"{status} for {what!r}: {body[:300]!r}"
    if status >= 400 and body and headers.get(b"content-type", b"").startswith(b"application/json"):
        error = json.loads(body)["error"]
        assert error["message"] and error["type"], body
    return status


# ---------------------------------------------------------------- strategies

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


@st.composite
def mutated(draw, fields_of: dict[str, list[str]]) -> tuple[str, bytes]:
    """A valid request with one field (known to the schema, or not) replaced or removed."""
    path = draw(st.sampled_from(PATHS))
    body = dict(BASE[path])
    name = draw(st.sampled_from([*fields_of[path], "tools", "x-unknown", ""]))
    if draw(st.integers(0, 5)) == 0:
        body.pop(name, None)
    else:
        body[name] = draw(json_values)
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 8))  # keep valid ones short
    return path, dumps(body)


token = st.text(
    alphabet="!#$%&'*+-.^_`|~ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789",
    min_size=1,
    max_size=12,
)  # noqa: E501
odd_text = st.text(st.characters(codec="latin-1"), max_size=40)


# ---------------------------------------------------------------- the fuzz


@fuzz_settings(0.45)
@given(
    path=st.sampled_from(PATHS),
    body=st.one_of(
        st.binary(max_size=300),
        json_values.map(dumps),
        st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    ),
)
def test_malformed_bodies_get_4xx(conn, path, body):
    check(conn.send(post(path, body)), body)


@fuzz_settings(0.35)
@given(data=st.data())
def test_every_schema_field_with_anything_in_it(conn, schema, data):
    fields_of = {
        path: list(
            schema["components"]["schemas"][
                op["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].split(
                    "/"
                )[-1]
            ]["properties"]
        )
        for path, op in schema["paths"].items()
        if path in PATHS
    }
    path, body = data.draw(mutated(fields_of))
    status = check(conn.send(post(path, body)), body)
    if status == 400:
        assert conn  # refused by the router or by the engine: both are the client's fault


@fuzz_settings(0.2)
@given(
    method=st.one_of(
        st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "POST"]), token
    ),
    path=st.one_of(
        st.sampled_from(
            [*PATHS, "/v1/models", "/openapi.json", "/", "//v1/models", "/v1/../v1/models"]
        ),
        st.text(alphabet="/%.?#&=abcv1:@!~*'()[]", max_size=30).map(lambda p: "/" + p),
    ),
    headers=st.lists(st.tuples(token, odd_text), max_size=6),
    body=st.binary(max_size=64),
)
def test_odd_methods_paths_and_headers(conn, method, path, headers, body):
    raw = request(method, path, body, headers)
    check(conn.send(raw), raw)


def test_limits_are_4xx_naming_the_limit(conn):
    chat = BASE["/v1/chat/completions"]
    deep = (
        b'{"model":"m","messages":[{"role":"user"}],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    )
    status, _, body = conn.send(post(PATHS[0], deep))
    assert status == 400 and f"{v.MAX_DEPTH} levels" in json.loads(body)["error"]["message"]
    # How many messages is the engine's to judge; the router only relays them.
    many = dumps({**chat, "messages": chat["messages"] * 3000, "max_tokens": 1})
    check(conn.send(post(PATHS[0], many)), "3000 messages")
    status, _, body = conn.send(post(PATHS[0], b" " * (1024 * 1024 + 1)))
    assert status == 413
    huge_head = request("GET", "/v1/models", headers=[("X-Pad", "a" * 40_000)])
    status, _, body = conn.send(huge_head)
    assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
    # With a key: without one, any body gets 401 before it is read.
    auth = ("Authorization", f"Bearer {KEY}")
    lies = request("POST", PATHS[0], b"{}", [auth, ("Content-Length", "nope")])
    assert conn.send(lies)[0] == 400
    # Declared shorter than sent: the rest is read as the next request, which is garbage.
    short = request("POST", PATHS[0], b"{}", [auth, ("Content-Length", "2")]).replace(
        b"Content-Length: 2\r\n\r\n{}", b"Content-Length: 2\r\n\r\n{}garbage\r\n\r\n"
    )
    assert conn.send(short)[0] == 400
    conn.close()


def test_the_router_still_serves_never_5xx_and_never_logs_a_key(router, conn, sim):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model="m-latest", messages=[{"role": "user", "content": "still there?"}], max_tokens=3
    )
    assert reply.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key=WRONG_KEY).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    assert router.proc.poll() is None
    metrics = httpx.get(router.admin_url + "/metrics", timeout=5).text
    statuses: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "llmgw_router_requests_total":
                status = sample.labels["status"]
                statuses[status] = statuses.get(status, 0) + sample.value
    assert sum(statuses.values()) > EXAMPLES / 2  # the fuzz reached the proxy
    assert not [s for s in statuses if s.startswith("5")], statuses
    log = open(router.log_path, errors="replace").read()
    assert len(log.splitlines()) > EXAMPLES / 2  # the access log was on: lines were written
    for secret in (KEY, WRONG_KEY, KEY[len(keys.KEY_PREFIX) :][:16]):
        assert secret not in log
    assert not re.search(r"Traceback|request failed inside the router", log), log[-3000:]
