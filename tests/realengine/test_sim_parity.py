"""The simulator against real vLLM: the same requests to both, compared field by field.

Each case is sent to `llmgw sim-engine` and to a real vLLM serving a tiny random model
(conftest.py builds it), and the answers are compared by shape (fields, JSON types) and by
the values that carry meaning (object kinds, roles, finish reasons, choice indices, tool-call parts,
event types and their order); see `parity.py`. Differences we know and accept are listed in
KNOWN with the reason; any other fails the test. The full report (null-only fields
included) is printed and written to `$LLMGW_PARITY_REPORT` when set.

vLLM runs with `--enable-auto-tool-choice --tool-call-parser hermes` (tool calls need a
parser) and `VLLM_ENABLE_RESPONSES_API_STORE=1` (retrieve needs the store), and a second
time as a pooling model for `/v1/embeddings`: one engine at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.dev.servers import free_port
from llmgw.dev.simkit import SimProcess, start_sim
from tests.realengine import kit, parity

pytestmark = pytest.mark.real_engine

MODEL = "tiny"
MAX_MODEL_LEN = 1024
USER = [{"role": "user", "content": "hello world"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A random model may pick end-of-sequence first; the token-counting cases go on to max_tokens.
NO_EOS = {"ignore_eos": True}

# Differences we accept, by "case:path" pattern, with why.
KNOWN: dict[str, str] = {
    "*:body.error.code": "vLLM's error code is the HTTP status as a number; the sim keeps "
    "OpenAI's (a string such as model_not_found, or null), which the SDK and router read",
    "*:body.error.param": "the sim names the offending field where vLLM often sends null",
    "*usage.prompt_tokens_details": "the sim reports cached prompt tokens, as vLLM does with "
    "--enable-prompt-tokens-details (off by default: null)",
    "tool required:choice 0 tool calls": "with tool_choice=required the model decides how "
    "many calls; the sim always makes one",
    "embeddings dimensions:*": "vLLM refuses `dimensions` for a model that is not "
    "Matryoshka; the sim acts as one and truncates",
    "tool auto:*": "with tool_choice=auto the model decides: the sim calls the first tool when "
    "the user spoke last (a random model answers text)",
}


# -- engines ---------------------------------------------------------------------------------


def launch_vllm(python: str, model: Path, log_path: Path, *flags: str, env=None) -> kit.Engine:
    """A vLLM with the parity test's own flags and environment, started (not yet healthy)."""
    port = free_port()
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        *flags,
    ]  # fmt: skip
    full_env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **(env or {}),
    }
    return kit.launch(argv, full_env, log_path, f"http://127.0.0.1:{port}")


def _started(vllm: kit.Engine) -> kit.Engine:
    try:
        vllm.wait_healthy()
    except BaseException:
        vllm.stop()
        raise
    return vllm


@pytest.fixture(scope="module")
def tiny(tiny_model) -> Path:
    """The tiny model of tests/realengine/conftest.py (which skips without vLLM, or fails
    under LLMGW_REQUIRE_REAL_ENGINE=1)."""
    return tiny_model


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with start_sim(served_model_name=[MODEL], max_model_len=MAX_MODEL_LEN, itl_ms=1) as s:
        yield s


@pytest.fixture(scope="module")
def report() -> Iterator[list[str]]:
    lines: list[str] = []
    yield lines
    text = "\n".join(lines)
    print("\n" + text)
    if path := os.environ.get("LLMGW_PARITY_REPORT"):
        Path(path).write_text(text + "\n")


# -- one exchange, reduced to what is compared ---------------------------------------------------


def _post(base: str, path: str, body: dict) -> tuple[int, str]:
    r = httpx.post(f"{base}{path}", json={"model": MODEL, **body}, timeout=300)
    return r.status_code, r.text


def _chunk_kind(chunk: dict) -> str:
    choices = chunk.get("choices")
    if choices == []:
        return "usage chunk"
    choice = choices[0] if choices else {}
    delta = choice.get("delta") or {}
    if "role" in delta:
        return "role chunk"
    if delta.get("tool_calls") and delta["tool_calls"][0].get("id"):
        return "tool header chunk"
    # Token and finish chunks are one kind: a loaded vLLM coalesces a short answer's tokens
    # into its finish chunk, so whether separate token chunks appear is down to timing.
    return "content chunk"


def _values_of_body(body: dict) -> dict[str, Any]:
    values: dict[str, Any] = {"object": body.get("object")}
    choices = body.get("choices")
    if isinstance(choices, list):
        values["choice indices"] = [c.get("index") for c in choices]
        values["finish reasons"] = [c.get("finish_reason") for c in choices]
        for c in choices:
            msg = c.get("message") or {}
            calls = msg.get("tool_calls") or []
            values[f"choice {c.get('index')} role"] = msg.get("role")
            values[f"choice {c.get('index')} tool calls"] = [
                (t.get("type"), t["function"].get("name"), t.get("id", "")[:14]) for t in calls
            ]
            values[f"choice {c.get('index')} content when tool call"] = (
                msg.get("content") if calls else "n/a"
            )
    if body.get("object") == "response":
        values["status"] = body.get("status")
        values["output types"] = [o.get("type") for o in body.get("output", [])]
    if "error" in body:
        values["error type"] = type(body["error"]).__name__
    return values


def _token_maps(value: Any) -> Any:
    """Completion logprobs' `top_logprobs` are maps keyed by token: their keys are data, so
    they become one `<token>` key before shapes are compared."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "top_logprobs" and isinstance(v, list) and v and isinstance(v[0], dict):
                if not {"token", "logprob"} <= set(v[0]):
                    v = [{"<token>": next(iter(m.values()), None)} for m in v]
            out[k] = _token_maps(v)
        return out
    if isinstance(value, list):
        return [_token_maps(v) for v in value]
    return value


def _reduce(status: int, text: str, stream: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shapes by part, meaningful values) of one answer."""
    values: dict[str, Any] = {"status": status}
    if not stream or status != 200:
        try:
            body = httpx.Response(200, content=text).json()
        except ValueError:
            return {"body": parity.shape(text)}, {**values, "body": "not JSON"}
        values.update(_values_of_body(body) if isinstance(body, dict) else {})
        return {"body": parity.shape(_token_maps(body))}, values
    events = parity.sse_events(text)
    shapes: dict[str, Any] = {}
    names = [name for name, _ in events]
    values["ends with [DONE]"] = bool(events) and events[-1][1] == "[DONE]"
    values["has event: lines"] = any(name is not None for name in names)
    datas = [_token_maps(d) for _, d in events if isinstance(d, dict)]
    if any(name is not None for name in names):
        # Responses: one shape per event type, and the sequence of types (runs collapsed).
        seq: list[str] = []
        for name, data in events:
            if isinstance(data, dict):
                data = _token_maps(data)
                shapes[name] = parity.merge(shapes.get(name), parity.shape(data))
                if not seq or seq[-1] != name:
                    seq.append(name)
        values["event sequence"] = seq
        values["sequence numbers"] = [d.get("sequence_number") for d in datas] == list(
            range(len(datas))
        )
        values["final status"] = datas[-1].get("response", {}).get("status") if datas else None
        return shapes, values
    kinds = []
    for chunk in datas:
        for choice in chunk.get("choices") or []:
            if choice.get("delta") == {}:
                # vLLM sends an empty delta for a token that decodes to no text yet (part of
                # a UTF-8 sequence, a special token): the same as empty content to a client.
                choice["delta"] = {"content": ""}
        kind = _chunk_kind(chunk)
        kinds.append(kind)
        shapes[kind] = parity.merge(shapes.get(kind), parity.shape(chunk))
    values["chunk kinds in order (runs collapsed)"] = (
        [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
        if len({c["choices"][0]["index"] for c in datas if c.get("choices")}) <= 1
        else sorted(set(kinds))
    )
    values["choice indices"] = sorted({c["choices"][0]["index"] for c in datas if c.get("choices")})
    values["finish reasons"] = sorted(
        {
            c["choices"][0]["finish_reason"]
            for c in datas
            if c.get("choices") and c["choices"][0].get("finish_reason")
        }
    )
    headers = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in datas
        if c.get("choices") and _chunk_kind(c) == "tool header chunk"
    ]
    values["tool header"] = [
        (h.get("type"), h.get("index"), h.get("function", {}).get("name"), h["id"][:14])
        for h in headers
    ]
    return shapes, values


def _compare(case: str, sim_answer, vllm_answer, stream: bool) -> list[parity.Difference]:
    s_shapes, s_values = _reduce(*sim_answer, stream)
    v_shapes, v_values = _reduce(*vllm_answer, stream)
    diffs = parity.diff_values(case, s_values, v_values)
    for part in sorted(set(s_shapes) | set(v_shapes)):
        if part not in s_shapes:
            diffs.append(parity.Difference(case, part, "missing in sim", "the sim never sends it"))
        elif part not in v_shapes:
            diffs.append(parity.Difference(case, part, "only in sim", "vLLM never sent it"))
        else:
            diffs += parity.diff_shapes(case, s_shapes[part], v_shapes[part], part)
    return diffs


def _judge(report: list[str], title: str, diffs: list[parity.Difference], notes=()) -> None:
    nulls, expected, unexpected = parity.classify(diffs, KNOWN)
    report.append(f"== {title}")
    report += [f"   note: {n}" for n in notes]
    report += [f"   UNEXPECTED {d}" for d in unexpected]
    report += [f"   known      {d}  ({why})" for d, why in expected]
    report += [f"   null-only  {d}" for d in nulls]
    assert not unexpected, "sim and vLLM disagree:\n" + "\n".join(map(str, unexpected))


# -- the cases -------------------------------------------------------------------------------

GENERATE_CASES: list[tuple[str, str, dict]] = [
    ("chat", "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **NO_EOS}),
    (
        "chat stream",
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            **NO_EOS,
        },
    ),
    ("chat n=2", "/v1/chat/completions", {"messages": USER, "n": 2, "max_tokens": 3, **NO_EOS}),
    (
        "chat n=2 stream",
        "/v1/chat/completions",
        {
            "messages": USER,
            "n": 2,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            **NO_EOS,
        },
    ),
    (
        "chat logprobs",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, **NO_EOS},
    ),
    (
        "chat logprobs stream",
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            **NO_EOS,
        },
    ),
    ("completion", "/v1/completions", {"prompt": "hello", "max_tokens": 3, **NO_EOS}),
    (
        "completion logprobs",
        "/v1/completions",
        {"prompt": "hello", "max_tokens": 3, "logprobs": 2, **NO_EOS},
    ),
    (
        "completion logprobs stream",
        "/v1/completions",
        {"prompt": "hello", "max_tokens": 3, "logprobs": 2, "stream": True, **NO_EOS},
    ),
    (
        "completion n=2 stream",
        "/v1/completions",
        {
            "prompt": "hello",
            "n": 2,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            **NO_EOS,
        },
    ),
    (
        "tool named",
        "/v1/chat/completions",
        {"messages": USER, "tools": [WEATHER], "tool_choice": NAMED, "max_tokens": 300},
    ),
    (
        "tool named stream",
        "/v1/chat/completions",
        {
            "messages": USER,
            "tools": [WEATHER],
            "tool_choice": NAMED,
            "max_tokens": 300,
            "stream": True,
        },
    ),
    (
        "tool required",
        "/v1/chat/completions",
        {"messages": USER, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 300},
    ),
    (
        "tool required stream",
        "/v1/chat/completions",
        {
            "messages": USER,
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_tokens": 300,
            "stream": True,
        },
    ),
    (
        "tool none",
        "/v1/chat/completions",
        {"messages": USER, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 3, **NO_EOS},
    ),
    (
        "tool auto",
        "/v1/chat/completions",
        {"messages": USER, "tools": [WEATHER], "max_tokens": 3, **NO_EOS},
    ),
    # Enough tokens that some decode to text: vLLM opens no message for an answer of none.
    ("responses", "/v1/responses", {"input": "hello world", "max_output_tokens": 6, **NO_EOS}),
    (
        "responses stream",
        "/v1/responses",
        {"input": "hello world", "max_output_tokens": 6, "stream": True, **NO_EOS},
    ),
    (
        "responses items + instructions",
        "/v1/responses",
        {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "instructions": "be brief",
            "max_output_tokens": 2,
            **NO_EOS,
        },
    ),
    (
        "responses logprobs stream",
        "/v1/responses",
        {
            "input": "hello world",
            "max_output_tokens": 6,
            "stream": True,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 2,
            **NO_EOS,
        },
    ),
    ("error: unknown model", "/v1/chat/completions", {"model": "nope", "messages": USER}),
    (
        "error: tool_choice names no tool",
        "/v1/chat/completions",
        {
            "messages": USER,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    ),
    (
        "error: top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": USER, "top_logprobs": 2},
    ),
]

EMBEDDING_CASES: list[tuple[str, dict]] = [
    ("embeddings string", {"input": "hello"}),
    ("embeddings list", {"input": ["hello", "world"]}),
    ("embeddings token ids", {"input": [[1, 2, 3]]}),
    ("embeddings base64", {"input": "hello", "encoding_format": "base64"}),
    ("embeddings empty list", {"input": []}),
    ("embeddings dimensions", {"input": "hello", "dimensions": 8}),
]


def _tool_call_made(answer: tuple[int, str], stream: bool) -> bool:
    status, text = answer
    if status != 200:
        return False
    return '"tool_calls":[{' in text.replace(" ", "")


# Runs first (file order), before the generate engine exists: one vLLM at a time.
def test_embeddings_match_vllm_pooling(vllm_python, tiny, sim, report, tmp_path):
    vllm = _started(
        launch_vllm(
            vllm_python,
            tiny,
            tmp_path / "vllm-embed.log",
            "--runner",
            "pooling",
            "--convert",
            "embed",
        )
    )
    try:
        diffs = []
        for case, body in EMBEDDING_CASES:
            s = _post(sim.url, "/v1/embeddings", body)
            v = _post(vllm.url, "/v1/embeddings", body)
            diffs += _compare(case, s, v, stream=False)
    finally:
        vllm.stop()
    _judge(report, "embeddings (vLLM --runner pooling --convert embed)", diffs)


@pytest.fixture(scope="module")
def vllm(vllm_python, tiny, tmp_path_factory) -> Iterator[kit.Engine]:
    engine = _started(
        launch_vllm(
            vllm_python,
            tiny,
            tmp_path_factory.mktemp("vllm") / "vllm.log",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
        )
    )
    try:
        yield engine
    finally:
        engine.stop()


def test_generation_matches_vllm(vllm, sim, report):
    diffs: list[parity.Difference] = []
    notes = []
    for case, path, body in GENERATE_CASES:
        stream = bool(body.get("stream"))
        s = _post(sim.url, path, body)
        v = _post(vllm.url, path, body)
        forced = case.startswith(("tool named", "tool required"))
        if forced and not _tool_call_made(v, stream):
            # The random model ran out of tokens inside its JSON: nothing to compare with.
            notes.append(f"{case}: vLLM's random model produced no complete tool call")
            continue
        diffs += _compare(case, s, v, stream)
    _judge(report, "chat, completions, tools, responses", diffs, notes)


def test_stored_responses_match_vllm(vllm, sim, report):
    diffs = []
    answers = {}
    for name, base in (("sim", sim.url), ("vllm", vllm.url)):
        created = httpx.post(
            f"{base}/v1/responses",
            json={"model": MODEL, "input": "hi", "max_output_tokens": 2, **NO_EOS},
            timeout=300,
        ).json()
        rid = created["id"]
        got = httpx.get(f"{base}/v1/responses/{rid}", timeout=30)
        cancel = httpx.post(f"{base}/v1/responses/{rid}/cancel", timeout=30)
        missing = httpx.get(f"{base}/v1/responses/resp_nope", timeout=30)
        answers[name] = [(r.status_code, r.text) for r in (got, cancel, missing)]
    for case, s, v in zip(
        ("retrieve", "cancel a finished response", "retrieve unknown id"),
        answers["sim"],
        answers["vllm"],
        strict=True,
    ):
        diffs += _compare(case, s, v, stream=False)
    _judge(report, "stored responses (VLLM_ENABLE_RESPONSES_API_STORE=1)", diffs)
