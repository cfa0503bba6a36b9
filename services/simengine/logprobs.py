"""Simulated log probabilities, in the shapes vLLM answers them.

The simulated model is confident and greedy-looking: the sampled token is always the most
likely one, with a log probability that depends only on its position (so answers repeat
exactly), and the alternatives are other lorem words, each less likely than the one before.

Chat (`logprobs: true`, `top_logprobs: k`): per token
`{"token", "logprob", "bytes", "top_logprobs": [k entries of {"token", "logprob", "bytes"}]}`,
the sampled token first. Completions (`logprobs: k`): parallel lists `tokens`,
`token_logprobs`, `text_offset` and `top_logprobs` (one `{token: logprob}` dict per token with
the sampled token and k alternatives), as vLLM sends them.
"""

from __future__ import annotations

from llmgw.simengine.tokens import LOREM_WORDS


def sampled(position: int) -> float:
    return round(-0.05 - 0.01 * (position % 17), 4)


def _alternatives(token: str, k: int, position: int) -> list[tuple[str, float]]:
    base = sampled(position)
    out = []
    j = position
    while len(out) < k:
        word = " " + LOREM_WORDS[j % len(LOREM_WORDS)]
        j += 7
        if word != token and all(word != w for w, _ in out):
            out.append((word, round(base - 1.0 - 0.5 * len(out), 4)))
    return out


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_content(pieces: list[str], start: int, top: int) -> dict:
    """`{"content": [...]}` for pieces[start:], positions counted from 0 at the answer's start."""
    content = []
    for i, piece in enumerate(pieces[start:], start):
        lp = sampled(i)
        tops = [_entry(piece, lp)] if top > 0 else []
        tops += [_entry(w, v) for w, v in _alternatives(piece, top - 1, i)] if top > 1 else []
        content.append({**_entry(piece, lp), "top_logprobs": tops})
    return {"content": content}


def completion(pieces: list[str], start: int, top: int, offset: int) -> dict:
    """The completion logprobs object for pieces[start:], the first starting at text `offset`."""
    tokens, values, offsets, tops = [], [], [], []
    for i, piece in enumerate(pieces[start:], start):
        lp = sampled(i)
        tokens.append(piece)
        values.append(lp)
        offsets.append(offset)
        offset += len(piece)
        alts = {piece: lp}
        alts.update(_alternatives(piece, top, i))
        tops.append(alts)
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": tops,
    }
