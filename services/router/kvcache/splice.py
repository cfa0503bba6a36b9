"""A prompt's token ids from a recent prompt's that shares its beginning, exactly.

Multi-turn traffic sends the same text again and again: each turn's prompt is the last
turn's plus the answer and a new question. Tokenizing every prompt whole costs the
router about a microsecond per token on its event loop (0.6-0.8 ms for an 800-token
prompt: a quarter of a router's CPU per request in bench_prefix_routing's real-vLLM
mode), most of it for text it tokenized a moment ago. `PrefixTokens` keeps recent
prompts' ids and, for a new prompt, reuses a recent one's up to a cut inside the text
they share and tokenizes only the rest.

It must be exact, not close: the router hashes blocks of these ids to match the blocks
the engine announces, and one id off shifts every later block. A cut is safe where no
token can span it and nothing before it depends on what follows. In a byte-level BPE
tokenizer (GPT-2's, Llama 3's: a ByteLevel pre-tokenizer, perhaps after regex Splits;
no normalizer) a line break that stands alone, a non-space character before it and
after it, is such a place: the split regexes end a piece right after it, whatever
follows, and BPE merges only inside a piece. (After a run of whitespace it is not:
GPT-2's regex splits two line breaks one way before a letter and another before an
added token.) So the ids before such a cut depend only on the text up to the character
after it, and the ids after it are the encoding of the rest alone. The place before an
added token split out in the tokenizer's first pass (a special token: a chat
template's role markers) is another: those are split out of the text before anything
else (leftmost, longest), so the text before one is tokenized alone, if the other text
shares as many characters after the cut as the longest added token has.

`splices_exactly` admits a tokenizer only in that shape, only if its pre-tokenizer
splits two lines joined at such a cut into the pieces of each alone (for lines ending
and beginning with every kind of character, its own added tokens among them: this
holds whatever the merges), and only if a check text cut at every line tokenizes
exactly as whole. Any other tokenizer (SentencePiece's Metaspace; a normalizer, Qwen
2's NFC included) is tokenized whole.
"""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# A prompt shorter than this is tokenized whole: cheap, and not worth an entry.
MIN_CHARS = 256
# Recent prompts are found by their first characters (a tenant's system prompt, say).
ANCHOR_CHARS = 64
# Prompts kept per anchor: conversations sharing a system prompt share an anchor, and
# each is one compare of the shared text (a few µs) when a prompt is looked up.
PER_ANCHOR = 128
# Bytes kept in all: 4 per id and the text (8 MiB: ~400 conversations of 4k tokens).
CAPACITY_BYTES = 8 << 20


class _Cuts:
    """A text's safe cuts, ascending: character offsets, the ids before each, and how
    many characters another text must share with this one for each to hold."""

    __slots__ = ("chars", "tokens", "needs")

    def __init__(self, chars=None, tokens=None, needs=None) -> None:
        self.chars: list[int] = chars if chars is not None else []
        self.tokens: list[int] = tokens if tokens is not None else []
        self.needs: list[int] = needs if needs is not None else []

    def add(self, char: int, tokens: int, need: int) -> None:
        if self.chars and self.chars[-1] >= char:  # the same place, found both ways
            if self.chars[-1] == char:
                self.needs[-1] = min(self.needs[-1], need)
            return
        self.chars.append(char)
        self.tokens.append(tokens)
        self.needs.append(need)

    def upto(self, i: int) -> _Cuts:
        """The first i + 1 cuts (a copy, to extend)."""
        n = i + 1
        return _Cuts(self.chars[:n], self.tokens[:n], self.needs[:n])

    def before(self, shared: int) -> int:
        """The index of the last cut that holds for a text sharing `shared` characters,
        or -1."""
        i = bisect.bisect_left(self.chars, shared) - 1
        needs = self.needs
        while i >= 0 and needs[i] > shared:
            i -= 1
        return i


class _Entry:
    __slots__ = ("text", "ids", "cuts", "size")

    def __init__(self, text: str, ids: array, cuts: _Cuts):
        self.text = text
        self.ids = ids  # array('i'): a ninth of a list's memory, ~25 µs per 1k ids to convert
        self.cuts = cuts
        self.size = 4 * len(ids) + len(text)


def _common_prefix(a: str, b: str) -> int:
    """How many leading characters a and b share (C-speed compares, log n of them)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTokens:
    """Recent prompts' token ids, reused for prompts that begin as they do.

    `whole(text)` and `rest(text)` are the tokenizer's encodings of a prompt (special
    tokens added as the engine adds them) and of a continuation (none added); both answer
    a `tokenizers.Encoding`. Only for tokenizers `splices_exactly` admits."""

    def __init__(
        self,
        whole: Callable[[str], Any],
        rest: Callable[[str], Any],
        capacity_bytes: int = CAPACITY_BYTES,
        added: dict[int, str] | None = None,
        added_len: int = 0,
    ) -> None:
        self.whole = whole
        self.rest = rest
        self.capacity_bytes = capacity_bytes
        # Added tokens (id -> text) a cut may precede: the tokenizer splits them out of
        # the text before anything else, so the text before one is tokenized alone.
        # Another text shares such a cut when it shares `added_len` characters after it
        # (the longest added token's length): no other match can then start before the
        # cut and span it.
        self.added = added or {}
        self.added_ids = frozenset(self.added)
        self.added_len = max(added_len, *map(len, self.added.values()), 0)
        self._anchors: dict[str, list[_Entry]] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()
        self._bytes = 0
        self.spliced = 0  # prompts tokenized from a cut (for tests and /debug)
        self.tokenized_chars = 0  # characters handed to the tokenizer

    def ids(self, text: str) -> list[int]:
        if len(text) < MIN_CHARS:
            self.tokenized_chars += len(text)
            return self.whole(text).ids
        anchor = text[:ANCHOR_CHARS]
        entries = self._anchors.get(anchor)
        best, cut, extended = self._best_cut(text, entries) if entries else (None, -1, [])
        if best is None:
            enc = self.whole(text)
            ids = new = enc.ids
            cuts = _Cuts()
            self._cuts(text, 0, enc, new, 0, cuts)
            self.tokenized_chars += len(text)
        else:
            at, before = best.cuts.chars[cut], best.cuts.tokens[cut]
            enc = self.rest(text[at:])
            new = enc.ids
            ids = best.ids[:before].tolist() + new
            cuts = best.cuts.upto(cut)
            self._cuts(text, at, enc, new, before, cuts)
            self.spliced += 1
            self.tokenized_chars += len(text) - at
        self._keep(anchor, _Entry(text, array("i", ids), cuts), entries, extended, best)
        return ids

    def _cuts(self, text: str, start: int, enc: Any, ids: list[int], base: int, cuts: _Cuts):
        """Add the safe cuts of text[start:] (encoded as `enc`, its `ids` after `base`
        ids) to `cuts`, in order: after each line break with a non-space character on
        both sides, and before each added token."""
        found: list[tuple[int, int, int]] = []
        end = len(text)
        i = text.find("\n", start)
        while i != -1:
            c = i + 1
            if c < end and i > 0 and not text[c].isspace() and not text[i - 1].isspace():
                t = enc.char_to_token(c - start)
                if t is not None:
                    found.append((c, base + t, c + 1))
            i = text.find("\n", c)
        if self.added_ids and not self.added_ids.isdisjoint(ids):
            added = self.added
            for t, tid in enumerate(ids):
                if tid in added:
                    span = enc.token_to_chars(t)
                    if span is None:
                        continue
                    c = start + span[0]
                    # Offsets a post-processor trimmed do not say where the token is.
                    content = added[tid]
                    if c > 0 and text.startswith(content, c) and span[1] - span[0] == len(content):
                        found.append((c, base + t, c + self.added_len))
            found.sort()
        for c, t, need in found:
            cuts.add(c, t, need)

    def _best_cut(
        self, text: str, entries: list[_Entry]
    ) -> tuple[_Entry | None, int, list[_Entry]]:
        """The entry and cut index sharing the most text with `text`, and the entries
        `text` extends (one pass over the anchor's entries, each compare made once): the
        latest entry it extends (the conversation's last turn) if one has a cut, else
        the most recent few by common prefix (another conversation under the same
        system prompt)."""
        n = len(text)
        extended = [e for e in entries if len(e.text) <= n and text.startswith(e.text)]
        for e in reversed(extended):
            i = e.cuts.before(len(e.text))
            if i >= 0:
                return e, i, extended
        best, best_at, cut = None, 0, -1
        for e in entries[-4:]:
            i = e.cuts.before(_common_prefix(text, e.text))
            if i >= 0 and e.cuts.chars[i] > best_at:
                best, best_at, cut = e, e.cuts.chars[i], i
        return best, cut, extended

    def _keep(
        self,
        anchor: str,
        entry: _Entry,
        entries: list[_Entry] | None,
        extended: list[_Entry],
        base: _Entry | None,
    ) -> None:
        if entries is None:
            entries = self._anchors[anchor] = []
        else:
            # A prompt this one extends is dominated by it: any text shares at least as
            # much with the longer one, at the same cuts. A base it does not extend (of
            # a new conversation) was used: it is recent again.
            for old in extended:
                self._drop(old, entries)
            if base is not None and base not in extended:
                entries.remove(base)
                entries.append(base)
                self._lru.move_to_end(id(base))
            if len(entries) >= PER_ANCHOR:
                self._drop(entries[0], entries)
        entries.append(entry)
        self._lru[id(entry)] = entry
        self._bytes += entry.size
        while self._bytes > self.capacity_bytes and self._lru:
            _, old = self._lru.popitem(last=False)
            self._bytes -= old.size
            group = self._anchors.get(old.text[:ANCHOR_CHARS])
            if group is not None:
                group.remove(old)
                if not group:
                    del self._anchors[old.text[:ANCHOR_CHARS]]

    def _drop(self, entry: _Entry, entries: list[_Entry]) -> None:
        entries.remove(entry)
        if self._lru.pop(id(entry), None) is not None:
            self._bytes -= entry.size


# Texts for the self-check: lines that begin with letters, digits, punctuation, added
# tokens, non-ASCII; blank lines, carriage returns, indents, long numbers.
_CHECK_LINES = (
    "You are a helpful assistant. Answer briefly, and cite the policy number.",
    "Question 12 from user 348201937: what is 1234567 + 89?",
    "12345 apples, 678 pears",
    "  indented line with    several   spaces",
    "\tTabbed",
    "",
    "- a list item; another: (parenthesised) [bracketed] {braced}",
    "Ünïcödé text, 中文字符, and emoji 🙂🙂 here",
    "line with a trailing space ",
    "windows line\r",
    "'s 're 've contractions don't break",
    "<b>bold</b> <|user|>hello<|assistant|>",
    "def f(x):\n    return x * 2",
    "",
    "",
    "!!! punctuation ??? ...",
)
# Characters a line may end or begin with, for the pre-tokenizer probe.
_EDGES = "aZé中🙂09'\"_-.,;:!?()[]{}<>|/\\@#$%^&*+=~`\u0301\u00a0\u2028"


def _check_text(added: list[str]) -> str:
    lines = list(_CHECK_LINES)
    for tok in added[:16]:  # the tokenizer's own: its chat template's markers, say
        lines += [f"{tok}user", "", f"{tok}", f"text {tok}", f"{tok[:1]}b{tok[1:]}"]
    out = []
    for i in range(3):
        for j, line in enumerate(lines):
            out.append(line if (i + j) % 3 else f"{line} w{i * 31 + j}")
    return "\n".join(out)


def _probe_pairs(added: list[str]) -> list[tuple[str, str]]:
    """Two lines for every (last character, next line's first) pair of `_EDGES` and the
    added tokens that meets at a cut (`PrefixTokens._cuts`: neither is whitespace)."""
    edges = [e for e in (*_EDGES, *added[:16]) if not e[0].isspace() and not e[-1].isspace()]
    return [(f"w{e}", f"{s}w") for e in edges for s in edges]


def _spec(tokenizer: Any) -> dict:
    """What the shape check reads, from the tokenizer's parts: serializing the whole
    tokenizer (a vocabulary of 128k tokens is megabytes of JSON) would hold the GIL,
    and so stall the router's event loop, for a fraction of a second."""
    import json

    pre = tokenizer.pre_tokenizer
    decoder = tokenizer.get_added_tokens_decoder()
    return {
        "normalizer": tokenizer.normalizer,
        "model": {"type": type(tokenizer.model).__name__},
        "pre_tokenizer": json.loads(pre.__getstate__()) if pre is not None else None,
        "added_tokens": [
            {
                "id": i,
                "content": t.content,
                "single_word": t.single_word,
                "lstrip": t.lstrip,
                "rstrip": t.rstrip,
                "normalized": t.normalized,
            }
            for i, t in sorted(decoder.items())  # by id, as tokenizer.json lists them
        ],
    }


def _shape_admits(spec: dict) -> bool:
    if spec.get("normalizer") is not None:
        return False
    if (spec.get("model") or {}).get("type") != "BPE":
        return False
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not parts or not any(p.get("type") == "ByteLevel" for p in parts):
        return False
    for p in parts:
        kind = p.get("type")
        if kind == "ByteLevel":
            if p.get("add_prefix_space"):
                return False
        elif kind == "Split":
            if p.get("behavior") != "Isolated" or p.get("invert"):
                return False
        else:
            return False
    for added in spec.get("added_tokens") or ():
        content = added.get("content", "")
        if "\n" in content or "\r" in content or added.get("lstrip") or added.get("rstrip"):
            return False
    return True


def _pieces_split_at_cuts(pre_tokenizer: Any, pairs: list[tuple[str, str]]) -> bool:
    """Whether, for each pair of lines, the pre-tokenizer's pieces of the two joined at a
    line break are the pieces of the first with the break, then those of the second
    alone: no piece spans the cut, and neither side's depends on the other (what an
    added token after the break would change). Then no merge, whatever the vocabulary,
    crosses a cut."""
    pieces = pre_tokenizer.pre_tokenize_str
    for left, right in pairs:
        joined = f"{left}\n{right}"
        shift = len(left) + 1
        alone = [(p, (a + shift, b + shift)) for p, (a, b) in pieces(right)]
        if pieces(joined) != pieces(left + "\n") + alone:
            return False
    return True


def splices_exactly(tokenizer: Any, special: bool) -> bool:
    """Whether prompts may be spliced for `tokenizer` (a `tokenizers.Tokenizer`; with
    `special`, its post-processor's special tokens added to whole prompts): the shape
    argued in this module's docstring, a line break its own piece at every cut of the
    probe text, and the check text and its forks tokenized as whole when spliced."""
    return _admitted(tokenizer, special) is not None


def _admitted(tokenizer: Any, special: bool) -> tuple[dict[int, str], int] | None:
    """If `splices_exactly`: the added tokens a cut may precede (id -> text) and the
    longest added token's length; else None."""
    try:
        spec = _spec(tokenizer)
    except Exception:
        return None
    if not _shape_admits(spec):
        return None
    entries = [a for a in spec.get("added_tokens") or () if a.get("content")]
    added = [a["content"] for a in entries]
    # Cuts go before the added tokens split out in the tokenizer's first pass (not
    # `normalized`: specials, and chat markers, by default); `normalized` ones are matched
    # in a second pass between those, and a first-pass token could start inside one and
    # end past the shared text. A `single_word` token matches only between word
    # boundaries: what precedes it counts.
    cut_before = {
        a["id"]: a["content"]
        for a in entries
        if not a.get("single_word") and a.get("normalized") is False
    }
    longest = max(map(len, added), default=0)
    try:
        if not _pieces_split_at_cuts(tokenizer.pre_tokenizer, _probe_pairs(added)):
            return None
        whole, rest = _encoders(tokenizer, special)
        text = _check_text(added)
        probe = PrefixTokens(whole, rest, added=cut_before, added_len=longest)
        # Every prefix that ends at a line's end, then the whole text: each extends the
        # last, so each is spliced from its predecessor.
        ends = [i for i, ch in enumerate(text) if ch == "\n"] + [len(text)]
        forks = [
            text[: len(text) // 2] + "\nDifferent continuation 42\n" + text[:80],
            text[: len(text) // 3] + "\n<b>" + text[:80],
        ]
        for tok in added[:8]:  # an added token, then a text that stops one short of it
            forks += [text[:300] + f"x{tok}y " + text[:40], text[:300] + f"x{tok[:-1]}y"]
        for part in [text[:end] for end in ends] + [text, *forks]:
            if len(part) >= MIN_CHARS and probe.ids(part) != whole(part).ids:
                return None
        return (cut_before, longest) if probe.spliced > 0 else None
    except Exception:
        return None


def _encoders(tokenizer: Any, special: bool) -> tuple[Callable[[str], Any], Callable[[str], Any]]:
    encode = tokenizer.encode

    def whole(text: str) -> Any:
        return encode(text, add_special_tokens=special)

    def rest(text: str) -> Any:
        return encode(text, add_special_tokens=False)

    return whole, rest


def prefix_tokens(tokenizer: Any, special: bool) -> PrefixTokens | None:
    """Splicing token ids for `tokenizer` (with `special`: its special tokens added to
    whole prompts), or None where `splices_exactly` does not admit it."""
    admitted = _admitted(tokenizer, special)
    if admitted is None:
        return None
    added, longest = admitted
    return PrefixTokens(*_encoders(tokenizer, special), added=added, added_len=longest)


def token_ids(tokenizer: Any, special: bool) -> Callable[[str], list[int]]:
    """A text's token ids from `tokenizer`: spliced from recent prompts' where that is
    exact (`prefix_tokens`), else the whole encoding's."""
    spliced = prefix_tokens(tokenizer, special)
    if spliced is not None:
        return spliced.ids
    whole, _ = _encoders(tokenizer, special)
    return lambda text: whole(text).ids
