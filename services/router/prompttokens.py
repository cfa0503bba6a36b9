"""A request's prompt as the engine's token ids, so the router can hash its blocks.

Engines publish which blocks they hold as canonical hashes of token ids
(llmgw.kvblocks); to use them the router needs the prompt's token ids, made the
way the engine makes them:

- the simulator (`engine: sim`): its own byte tokens of the prompt it renders (its
  ChatML-like template, llmgw.chatprompt), computed here exactly;
- vLLM with a tokenizer the catalog names (`scheduling.tokenizer`: a tokenizer.json
  or a directory holding one): completions prompts are encoded with the
  `tokenizers` package (special tokens added, as vLLM does); chat requests are
  rendered with the directory's chat template (tokenizer_config.json) when the
  `jinja2` package is importable, and otherwise have no token ids;
- anything else has no token ids.

Without token ids an endpoint is scored by the approximate prefix guess instead.
Nothing here raises on odd input: a prompt it cannot read has no token ids.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

import msgspec

from llmgw.chatprompt import message_text, pack_token_ids, render_chat
from llmgw.kvblocks import sim_token_bytes

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


class HfTokens:
    """A model's own tokenizer (tokenizers) and, with jinja2, its chat template."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        self.tokenizer = Tokenizer.from_file(str(file))
        self.template = None
        self.special: dict[str, str] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        if cfg_file.exists():
            cfg = json.loads(cfg_file.read_text())
            for key in ("bos_token", "eos_token"):
                tok = cfg.get(key)
                if isinstance(tok, dict):
                    tok = tok.get("content")
                if isinstance(tok, str):
                    self.special[key] = tok
            template = cfg.get("chat_template")
            if isinstance(template, str):
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
                    messages=msgs, add_generation_prompt=True, **self.special
                )
            except Exception:
                return None
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        prompt = _completion(raw)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        return prompt


@lru_cache(maxsize=32)
def hf_tokens(path: str) -> HfTokens | None:
    try:
        return HfTokens(path)
    except Exception as exc:
        log.warning(
            "cannot load tokenizer %s (%s): its endpoints are scored approximately", path, exc
        )
        return None


def tokens_for(engine: str, tokenizer: str, raw: bytes) -> bytes | list[int] | None:
    """The prompt's token ids as an endpoint of this engine kind would see them, or None."""
    if engine == "sim":
        return sim_tokens(raw)
    if tokenizer:
        tok = hf_tokens(tokenizer)
        if tok is not None:
            return tok.tokens(raw)
    return None
