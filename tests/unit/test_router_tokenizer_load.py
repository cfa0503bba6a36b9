"""The router loads a model's tokenizer off the request path and retries a failure."""

from __future__ import annotations

import json
import time

import msgspec
from tokenizers import Tokenizer, models, pre_tokenizers

from llmgw.router.kvcache.tokens import HfTokens, TokenizerLoader

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(directory) -> None:
    words = ["<unk>", "hello", "world", "again", "<|user|>", "<|assistant|>", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_missing_tokenizer_is_retried_with_backoff_and_never_loaded_in_a_request(tmp_path):
    clock = Clock()
    loader = TokenizerLoader(clock=clock, first_retry=5.0, max_retry=20.0)
    path = str(tmp_path)
    assert loader.wait(path, 10) is None  # no tokenizer.json yet: approximate scoring
    write_tokenizer(tmp_path)
    assert loader.get(path) is None  # backing off: not retried, nothing blocks
    time.sleep(0.05)
    assert path not in loader.loaded
    clock.t = 5.1
    loader.get(path)  # the back-off ran out: the next request starts a retry, in a thread
    assert loader.wait(path, 10) is not None
    assert loader.get(path) is loader.loaded[path]


def test_chat_content_lists_are_flattened_as_vllm_does(tmp_path):
    write_tokenizer(tmp_path)
    tok = HfTokens(str(tmp_path))
    as_string = [{"role": "user", "content": "hello\nworld"}]
    as_parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
        }
    ]
    ids = tok.tokens(msgspec.json.encode(as_string))
    assert ids and tok.tokens(msgspec.json.encode(as_parts)) == ids
