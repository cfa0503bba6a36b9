"""A request's prompt as the engine's token ids, so the router can hash its blocks.

Engines publish which blocks they hold as canonical hashes of token ids
(llmgw.kvblocks); to use them the router needs the prompt's token ids, made the
way the engine makes them:

- the simulator (`engine: sim`): its own byte tokens of the prompt it renders (its
  ChatML-like template, llmgw.chatprompt), computed here exactly;
- vLLM or SGLang with a tokenizer the catalog names (`scheduling.tokenizer`: a tokenizer.json
  or a directory holding one): completions prompts are encoded with the
  `tokenizers` package (special tokens added, as vLLM does); chat requests are
  rendered with the directory's chat template (chat_template.jinja, else
  tokenizer_config.json's; jinja2), content lists flattened to text as vLLM does (a
  chat with fields vLLM also renders, tools among them, has no token ids:
  `engine_prompt`); the tokenizer is loaded in a thread when the
  route is installed (TokenizerLoader), and until then there are no token ids; a
  prompt that begins as a recent one did reuses that one's ids and tokenizes only the
  rest, where the tokenizer's shape makes that exact (splice.py);
- anything else has no token ids.

Without token ids an endpoint is scored by the approximate prefix guess instead. The
request's cache_salt is not part of the token ids: the scorer hashes it into the first
block (llmgw.kvblocks.salt_extra), as engines do.
Nothing here raises on odd input: a prompt it cannot read has no token ids.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import msgspec

from llmgw.chatprompt import content_text, message_text, pack_token_ids, render_chat
from llmgw.engines import ENGINES
from llmgw.kvblocks import sim_token_bytes
from llmgw.router.kvcache.splice import token_ids

log = logging.getLogger(__name__)

_json = msgspec.json.Decoder()


def _messages(raw: bytes) -> list[dict] | None:
    """The chat messages if `raw` (the request's `messages` or `prompt` JSON) is a chat."""
    stripped = raw.lstrip()
    if not stripped.startswith(b"["):
        return None
    rest = stripped[1:].lstrip()
    if not rest.startswith(b"{"):
        return None
    try:
        msgs = _json.decode(raw)
    except msgspec.DecodeError:
        return None
    return msgs if all(isinstance(m, dict) for m in msgs) else None


def _completion(raw: bytes) -> str | list[int] | None:
    try:
        prompt = _json.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def sim_tokens(raw: bytes) -> bytes | None:
    """The simulator's tokens of this prompt, as kvblocks.token_bytes."""
    msgs = _messages(raw)
    if msgs is not None:
        turns = [
            (str(m.get("role", "")), message_text(m.get("content"), m.get("tool_calls")))
            for m in msgs
        ]
        return sim_token_bytes(render_chat(turns))
    prompt = _completion(raw)
    if isinstance(prompt, str):
        return sim_token_bytes(prompt.encode())
    if isinstance(prompt, list):
        if not all(0 <= t < 2**32 for t in prompt):
            return None
        return sim_token_bytes(pack_token_ids(prompt))
    return None


def flatten_contents(msgs: list[dict]) -> list[dict]:
    """Messages as vLLM hands them to a chat template: a content list becomes the text of
    its text parts joined by newlines (vLLM's "string" content format, what templates
    that expect string content get; llmgw.chatprompt.content_text); other parts
    (images) are left out."""
    out = msgs
    for i, m in enumerate(msgs):
        content = m.get("content")
        if isinstance(content, list):
            if out is msgs:
                out = list(msgs)
            out[i] = {**m, "content": content_text(content)}
    return out


def chat_template(cfg: dict, directory: Path) -> str | None:
    """The model's chat template as transformers (and so vLLM) picks it: the
    chat_template.jinja beside tokenizer_config.json first (where transformers saves it
    since 4.43; it takes priority), else the config's `chat_template` (a string, or a
    list of named ones: "default")."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class HfTokens:
    """A model's own tokenizer (tokenizers) and, with jinja2, its chat template."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        self.tokenizer = Tokenizer.from_file(str(file))
        # Completions prompts get the engine's special tokens (a BOS), rendered chats
        # carry theirs in the template's text.
        self.prompt_ids = token_ids(self.tokenizer, special=True)
        self.chat_ids = token_ids(self.tokenizer, special=False)
        self.template = None
        self.special: dict[str, str] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.exists() else {}
        for key in ("bos_token", "eos_token"):
            tok = cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str):
                self.special[key] = tok
        template = chat_template(cfg, file.parent)
        if template is not None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                self.template = env.from_string(template)
            except ImportError:
                log.info("no jinja2: chat requests to %s are scored approximately", path)

    def tokens(self, raw: bytes) -> list[int] | None:
        msgs = _messages(raw)
        if msgs is not None:
            if self.template is None:
                return None
            try:
                text = self.template.render(
                    messages=flatten_contents(msgs), add_generation_prompt=True, **self.special
                )
            except Exception:
                return None
            return self.chat_ids(text)
        prompt = _completion(raw)
        if isinstance(prompt, str):
            return self.prompt_ids(prompt)
        return prompt


class TokenizerLoader:
    """Models' tokenizers, loaded off the request path.

    A route that names a tokenizer asks for it when it is installed (`want`): a thread
    reads tokenizer.json and the template, never the event loop. Until it is loaded,
    or while it cannot be (a missing file, a mount not there yet), `get` answers None
    and the endpoints are scored approximately; a failure is retried, after 5 s, then
    twice as long each time, up to 5 min, when the route is installed again or a
    request asks after the back-off ran out.
    """

    def __init__(self, clock=time.monotonic, first_retry: float = 5.0, max_retry: float = 300.0):
        self.clock = clock
        self.first_retry = first_retry
        self.max_retry = max_retry
        self.loaded: dict[str, HfTokens] = {}
        self._loading: set[str] = set()
        self._retry_at: dict[str, tuple[float, float]] = {}  # path -> (when, next back-off)
        self._lock = threading.Lock()

    def want(self, path: str) -> None:
        """Start loading `path` in a thread unless loaded, loading, or backing off."""
        if not path or path in self.loaded:
            return
        with self._lock:
            if path in self._loading or path in self.loaded:
                return
            retry = self._retry_at.get(path)
            if retry is not None and self.clock() < retry[0]:
                return
            self._loading.add(path)
        threading.Thread(
            target=self._load, args=(path,), name="tokenizer-load", daemon=True
        ).start()

    def _load(self, path: str) -> None:
        try:
            tok = HfTokens(path)
        except Exception as exc:
            with self._lock:
                _, backoff = self._retry_at.get(path, (0.0, self.first_retry))
                self._retry_at[path] = (self.clock() + backoff, min(2 * backoff, self.max_retry))
                self._loading.discard(path)
            log.warning(
                "cannot load tokenizer %s (%s): its endpoints are scored approximately; "
                "retrying in %.0f s",
                path,
                exc,
                backoff,
            )
            return
        with self._lock:
            self.loaded[path] = tok
            self._retry_at.pop(path, None)
            self._loading.discard(path)
        log.info("tokenizer %s loaded", path)

    def get(self, path: str) -> HfTokens | None:
        """The loaded tokenizer, or None (a load is started or retried if due)."""
        tok = self.loaded.get(path)
        if tok is None:
            self.want(path)
        return tok

    def wait(self, path: str, timeout: float) -> HfTokens | None:
        """For tests and benches: want, then wait up to `timeout` for the load."""
        deadline = time.monotonic() + timeout
        self.want(path)
        while path not in self.loaded and time.monotonic() < deadline:
            with self._lock:
                if path not in self._loading:
                    break
            time.sleep(0.01)
        return self.loaded.get(path)


TOKENIZERS = TokenizerLoader()


# Request fields vLLM renders into the prompt besides the messages (vLLM's
# ChatCompletionRequest), and `add_special_tokens`, which adds a second BOS to a chat or
# none to a completion. The router renders the messages alone, as vLLM does by default,
# so the ids of a request with any of them would differ from the engine's from where
# the template puts them (tools: often in the first turn's text) and match nothing;
# such a request is scored by the approximate guess instead.
_TEMPLATE_FIELDS = (
    b'"tools"',
    b'"documents"',
    b'"chat_template"',
    b'"chat_template_kwargs"',
    b'"add_special_tokens"',
    b'"reasoning_effort"',  # a template argument; some templates put it in the system turn
)


class _Responses(msgspec.Struct):
    """What of a Responses request decides the messages vLLM renders it from."""

    input: msgspec.Raw = msgspec.Raw(b"")
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: msgspec.Raw | None = None
    prompt: msgspec.Raw | None = None  # a stored prompt template's reference
    reasoning: msgspec.Raw | None = None  # its effort becomes template arguments


_responses = msgspec.json.Decoder(_Responses)
_ROLES = frozenset(("user", "system", "assistant"))


def _responses_messages(body: bytes) -> list[dict] | None:
    """The messages vLLM 0.32 renders a Responses request from
    (`construct_input_messages`), where the body alone tells them: `instructions` as a
    system message first, then a string input as a user message, or the input's
    messages if each is a user, system or assistant message with string content. None
    for anything else: a previous response's or conversation's turns (held by the
    engine), other items (tool calls and outputs, reasoning), content lists."""
    try:
        req = _responses.decode(body)
        value = _json.decode(req.input) if req.input else None
    except msgspec.DecodeError:
        return None
    if (
        req.previous_response_id is not None
        or req.conversation is not None
        or req.prompt is not None
        or req.reasoning is not None
    ):
        return None
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        return None
    for item in value:
        if not isinstance(item, dict) or item.keys() - {"role", "content", "type"}:
            return None
        role, content = item.get("role"), item.get("content")
        if item.get("type", "message") != "message" or not isinstance(role, str):
            return None
        if role not in _ROLES or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    return messages


def engine_prompt(body: bytes, prompt: bytes, responses: bool = False) -> bytes | None:
    """What a model's tokenizer is to render to make the ids the engine makes of this
    request: its `prompt` (the raw `messages` or `prompt`) as it is, or for a Responses
    request (`responses`; `input` is its prompt) the messages vLLM builds of it; None
    when the engine renders the request from more than the router can (the approximate
    guess scores it).

    The chat fields are found by a byte search: quotes inside a message are escaped, so
    a message that mentions "tools" does not match; a string value or a nested key that
    is exactly "tools" does, and is scored approximately for nothing worse."""
    if any(field in body for field in _TEMPLATE_FIELDS):
        return None
    if responses:
        messages = _responses_messages(body)
        return None if messages is None else msgspec.json.encode(messages)
    return prompt


def tokens_for(
    engine: str, tokenizer: str, raw: bytes, rendered: bytes | None
) -> bytes | list[int] | None:
    """The prompt's token ids as an endpoint of this engine kind would see them, or None.
    `raw` is the request's prompt field, `rendered` what the model's tokenizer renders
    for the engine's ids (`engine_prompt`; None: it cannot make them)."""
    traits = ENGINES.get(engine)
    if traits is not None and traits.sim_tokens:
        return sim_tokens(raw)
    if tokenizer and rendered is not None:
        tok = TOKENIZERS.get(tokenizer)
        if tok is not None:
            return tok.tokens(rendered)
    return None
