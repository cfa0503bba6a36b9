"""A prompt that begins as a recent one is tokenized from that one's ids, exactly.

The router hashes blocks of these ids against the blocks the engine announces, so an id
off anywhere makes every later block miss: each test compares the spliced ids with the
tokenizer's own encoding of the whole text.
"""

from __future__ import annotations

import json
import random

import msgspec
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from llmgw.router.kvcache.splice import PrefixTokens, prefix_tokens, splices_exactly
from llmgw.router.kvcache.tokens import HfTokens

# Llama 3's split pattern (tokenizer.json of Meta-Llama-3-8B).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PIECES = (
    "tenant", "policy", "Answer", "the", "model", "12345", "3.14", "-", "(x)", "don't",
    "ünïcödé", "中文", "🙂", "  ", "\t", "!!", "...", "q17", "w4821", "<|user|>",
    "<|assistant|>", "<b>", "<", "|",
)  # fmt: skip


def random_line(rng: random.Random) -> str:
    line = " ".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
    return rng.choice(("", " ", "  ", "- ", "1. ")) + line + rng.choice(("", " ", "\r", ":"))


def train(pre, special: bool = True, normalizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre
    tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(0)
    # Multi-line texts, so merges across newlines and indents ("\n  ") are learnt.
    texts = ["\n".join(random_line(rng) for _ in range(8)) for _ in range(300)]
    tok.train_from_iterator(texts, trainer=trainer)
    if special:  # a BOS added to every completions prompt, as Llama's tokenizers do
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return tok


def byte_level() -> Tokenizer:
    return train(pre_tokenizers.ByteLevel(add_prefix_space=False))


def llama3_like() -> Tokenizer:
    return train(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )


def encoders(tok: Tokenizer, special: bool = True):
    def whole(text):
        return tok.encode(text, add_special_tokens=special)

    def rest(text):
        return tok.encode(text, add_special_tokens=False)

    return whole, rest


def conversations(rng: random.Random, steps: int):
    """Prompts as multi-turn traffic sends them: a few system prompts shared by many
    conversations, each turn the last prompt plus an answer and a question."""
    systems = ["\n".join(random_line(rng) for _ in range(rng.randint(4, 10))) for _ in range(4)]
    live = [[rng.choice(systems)] for _ in range(6)]
    for _ in range(steps):
        turns = rng.choice(live)
        turns.append(rng.choice(("", "<|user|>", "<b>")) + random_line(rng))
        yield "\n".join(turns)
        turns.append(random_line(rng) + rng.choice(("", "\n", "\n\n", " \n")))
        if len(turns) > 12:
            turns[:] = [rng.choice(systems)]


def check_against_whole(tok: Tokenizer, special: bool, steps: int = 400, **kw) -> PrefixTokens:
    whole, _ = encoders(tok, special)
    assert splices_exactly(tok, special)
    pt = prefix_tokens(tok, special)
    assert pt is not None
    pt.capacity_bytes = kw.get("capacity_bytes", pt.capacity_bytes)
    total = 0
    for i, prompt in enumerate(conversations(random.Random(special), steps)):
        assert pt.ids(prompt) == whole(prompt).ids, f"prompt {i}: {prompt!r}"
        total += len(prompt)
    assert pt.tokenized_chars < total / 2, "most of the text was tokenized again"
    return pt


def test_byte_level_bpe_prompts_are_spliced_and_identical_to_whole_encoding():
    tok = byte_level()
    pt = check_against_whole(tok, special=True)
    assert pt.spliced > 300
    check_against_whole(tok, special=False)  # rendered chats: no BOS added


def test_llama3_style_split_then_byte_level_is_spliced_exactly():
    check_against_whole(llama3_like(), special=True)


def test_a_new_conversation_reuses_its_system_prompt_from_another_conversation():
    tok = byte_level()
    whole, rest = encoders(tok)
    pt = PrefixTokens(whole, rest)
    system = "\n".join(f"Rule {i}: answer tenant seven politely, cite (x) 12345" for i in range(12))
    pt.ids(system + "\nFirst user asks about the model")
    before = pt.tokenized_chars
    other = system + "\nA different user asks something else"
    assert pt.ids(other) == whole(other).ids
    assert pt.spliced == 1
    assert pt.tokenized_chars - before < len("\nA different user asks something else") + 60


def test_the_kept_ids_stay_within_capacity_and_stay_exact():
    tok = byte_level()
    pt = check_against_whole(tok, special=True, capacity_bytes=20_000)
    assert pt._bytes <= 20_000
    kept = list(pt._lru.values())
    assert sum(4 * len(e.ids) + len(e.text) for e in kept) == pt._bytes
    by_anchor = [e for group in pt._anchors.values() for e in group]
    assert sorted(map(id, by_anchor)) == sorted(map(id, kept))
    assert all(pt._anchors.values())


def test_many_conversations_under_one_system_prompt_each_extend_their_own():
    tok = byte_level()
    whole, rest = encoders(tok)
    pt = PrefixTokens(whole, rest)
    system = "\n".join(f"Rule {i}: answer politely, cite (x) 12345" for i in range(10))
    rng = random.Random(5)
    conversations = [system] * 60  # more than fit one anchor's list before
    total = 0
    for turn in range(4):
        for k in range(len(conversations)):
            conversations[k] += f"\nUser {k} turn {turn}: {random_line(rng)}x\nAnswer {turn}"
            prompt = conversations[k]
            assert pt.ids(prompt) == whole(prompt).ids
            total += len(prompt)
    assert pt.tokenized_chars < total / 4


def test_a_blank_line_before_an_added_token_is_never_a_cut():
    # GPT-2's regex splits two line breaks one way before a letter ("ĊĊ" merged) and
    # another before an added token, so no cut may follow a run of whitespace.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["para one.\n\nPara two.\n\n<b>x</b>\n\n"] * 50, trainer=trainer)
    assert tok.token_to_id("ĊĊ") is not None
    system = "You are a helpful assistant.\nBe brief.\n" * 10
    a = system + "\n\n<|im_start|>user\nhello"
    b = system + "\n\n<b>bold</b> and more text"
    whole, rest = encoders(tok, special=False)
    assert splices_exactly(tok, special=False)
    for first, second in ((a, b), (b, a)):
        pt = PrefixTokens(whole, rest)
        pt.ids(first)
        assert pt.ids(second) == whole(second).ids
        assert pt.spliced == 1  # from the system prompt's single line breaks


def test_tokenizers_of_other_shapes_are_never_spliced():
    metaspace = train(pre_tokenizers.Metaspace(), special=False)
    with_normalizer = train(
        pre_tokenizers.ByteLevel(add_prefix_space=False), normalizer=normalizers.NFKC()
    )
    prefix_space = train(pre_tokenizers.ByteLevel(add_prefix_space=True))
    newline_token = byte_level()
    newline_token.add_special_tokens(["<|end|>\n"])
    for tok in (metaspace, with_normalizer, prefix_space, newline_token):
        assert not splices_exactly(tok, special=True)
    # An EOS appended to every prompt: a prefix's ids are not the start of the whole's.
    eos = byte_level()
    eos.post_processor = processors.TemplateProcessing(
        single="<s> $A <unk>", special_tokens=[("<s>", 1), ("<unk>", 0)]
    )
    assert not splices_exactly(eos, special=True)
    assert splices_exactly(eos, special=False)  # rendered chats add no special tokens


def test_a_split_that_keeps_line_breaks_inside_pieces_is_refused_whatever_it_learnt():
    # Pieces end only at digits: a line break is inside a piece, and a merge across it
    # ("Ċ" + a capital) would make a cut wrong, whether or not the check text has one.
    tok = train(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    assert not splices_exactly(tok, special=True)


def test_the_self_check_refuses_a_split_that_spans_lines():
    # Admissible in shape (Split, then ByteLevel) but its pieces are runs of 7
    # characters, newlines included: a cut after a newline is not safe.
    tok = train(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"[\s\S]{1,7}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    whole, rest = encoders(tok)
    text = "\n".join(f"line {i} of the text" for i in range(40))
    spliced = PrefixTokens(whole, rest)
    spliced.ids(text[:400])
    assert spliced.ids(text) != whole(text).ids  # what splicing it would get wrong
    assert not splices_exactly(tok, special=True)


def test_hf_tokens_splices_completions_and_chats_through_the_router_path(tmp_path):
    tok = byte_level()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    hf = HfTokens(str(tmp_path))
    rng = random.Random(3)
    messages = [{"role": "system", "content": "\n".join(random_line(rng) for _ in range(20))}]
    prompt = messages[0]["content"]
    for _ in range(6):
        question = random_line(rng) + " what now?"
        messages.append({"role": "user", "content": question})
        prompt += "\n" + question
        got = hf.tokens(msgspec.json.encode(prompt))
        assert got == tok.encode(prompt, add_special_tokens=True).ids
        text = hf.template.render(messages=messages, add_generation_prompt=True)
        assert (
            hf.tokens(msgspec.json.encode(messages))
            == tok.encode(text, add_special_tokens=False).ids
        )
        answer = random_line(rng) + " done"
        messages.append({"role": "assistant", "content": answer})
        prompt += "\n" + answer
    assert hf.prompt_ids.__self__.spliced >= 4
    assert hf.chat_ids.__self__.spliced >= 4


def test_a_chat_template_without_line_breaks_is_cut_before_its_added_tokens():
    # Llama 3's template: a blank line after each role header, none between messages,
    # so single-line contents leave no line-break cut; the added tokens are the cuts.
    tok = byte_level()
    tok.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    pt = prefix_tokens(tok, special=False)
    assert pt is not None and pt.added_len == len("<|start_header_id|>")
    whole, _ = encoders(tok, special=False)
    rng = random.Random(7)

    def render(messages):
        return (
            "<s>"
            + "".join(
                f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>"
                for role, content in messages
            )
            + "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )

    system = ("system", " ".join(random_line(rng) for _ in range(8)))
    chats = [[system] for _ in range(5)]
    total = 0
    for _ in range(6):
        for chat in chats:
            chat.append(("user", random_line(rng) + " question?"))
            text = render(chat)
            assert pt.ids(text) == whole(text).ids, text
            total += len(text)
            chat.append(("assistant", random_line(rng)))
    assert pt.spliced >= 5 * 6 - 1
    assert pt.tokenized_chars < total / 3
    # A text that has all but the last character of an added token where a kept one
    # has it whole shares no cut before it: there the space before is a piece of its
    # own, here it joins the punctuation that follows.
    base = render([system]) + "words and more words "
    kept = base + "<|eot_id|>" + render([system])
    pt.ids(kept)
    near = base + "<|eot_id| not a token"
    assert pt.ids(near) == whole(near).ids


OVERLAPPING = (
    "<|im", "<|im_start|>", "<|im_end|>", "im_start", "|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "<|eot", "header", "<tool_call>", "call>",
)  # fmt: skip
MARKED_PIECES = (*PIECES, "\n", " ", "x", ":", "<", "|", ">", "im", "_start", "id|>")


def marked_line(rng: random.Random) -> str:
    """Added tokens, cut-off added tokens and pieces of text, run together."""
    parts = []
    for _ in range(rng.randint(1, 10)):
        r = rng.random()
        t = rng.choice(OVERLAPPING) if r < 0.35 else rng.choice(MARKED_PIECES)
        if 0.25 <= r < 0.35:
            t = t[: rng.randint(1, len(t))]
        parts.append(t + rng.choice(("", "", " ", "\n")))
    return "".join(parts)


def test_added_tokens_that_overlap_or_sit_in_a_second_pass_splice_exactly():
    # Added tokens that are prefixes and substrings of each other, specials (split out
    # first) mixed with normalized ones (matched between them afterwards), and texts
    # that fork a few characters past one: every prompt's ids equal the whole encoding.
    from tokenizers import AddedToken

    for mixed in (False, True):
        tok = byte_level()
        tok.add_tokens(
            [
                AddedToken(t, normalized=mixed and i % 2 == 0, special=i % 3 == 0)
                for i, t in enumerate(OVERLAPPING)
            ]
        )
        for special in (False, True):
            pt = prefix_tokens(tok, special)
            assert pt is not None
            whole, _ = encoders(tok, special)
            rng = random.Random(11 + 2 * mixed + special)
            system = "<|start_header_id|>system<|end_header_id|>\n\n" + " ".join(
                random_line(rng) for _ in range(20)
            )
            texts: list[str] = []
            for _ in range(300):
                if texts and rng.random() < 0.5:
                    base = rng.choice(texts)
                    marks = [i for i in range(len(base)) if base.startswith(OVERLAPPING, i)]
                    at = rng.choice(marks) if marks else rng.randrange(len(base))
                    text = base[: min(len(base), at + rng.randint(0, 22))] + marked_line(rng)
                elif texts and rng.random() < 0.7:
                    text = rng.choice(texts) + marked_line(rng)
                else:
                    text = system + marked_line(rng)
                assert pt.ids(text) == whole(text).ids, repr(text[-120:])
                texts = [*texts[-59:], text]
            assert pt.spliced > 100


def test_an_added_token_whose_offsets_a_post_processor_trimmed_is_not_cut_before():
    # ByteLevel's trim_offsets moves the reported start of " <sep>" past its space: a cut
    # there would fall inside the token.
    from tokenizers import AddedToken

    tok = byte_level()
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(20)])
    tok.add_tokens([AddedToken(" <sep>", normalized=False)])
    tok.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=True), tok.post_processor]
    )
    pt = prefix_tokens(tok, special=False)
    assert pt is not None
    whole, _ = encoders(tok, special=False)
    head = "You are a helpful assistant.\nAnswer briefly. " * 6 + "answer"
    pt.ids(head + " <sep>first one is here and long enough" * 2)
    second = head + " <sep>first one is here and long enough and then another"
    assert pt.ids(second) == whole(second).ids


def test_the_chat_template_is_found_where_transformers_looks(tmp_path):
    from llmgw.router.kvcache.tokens import chat_template

    assert chat_template({}, tmp_path) is None
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert chat_template({"chat_template": named}, tmp_path) == "D"
    assert chat_template({"chat_template": "C"}, tmp_path) == "C"
    (tmp_path / "chat_template.jinja").write_text("J ✓", encoding="utf-8")
    assert chat_template({"chat_template": "C"}, tmp_path) == "J ✓"  # the file wins


def test_a_cut_before_an_added_token_needs_the_longest_added_token_shared():
    # "header" is cut before where "<|start_header" is not a whole token; a text that
    # shares "header" and goes on to "_id|>" holds "<|start_header_id|>", which starts
    # before the cut and spans it.
    tok = byte_level()
    tok.add_special_tokens(["header", "<|start_header_id|>"])
    pt = prefix_tokens(tok, special=False)
    assert pt is not None
    whole, _ = encoders(tok, special=False)
    head = "You are a helpful assistant.\nAnswer briefly. " * 6 + "<|start_"
    pt.ids(head + "header and more text after it")
    other = head + "header_id|>user question"
    assert pt.ids(other) == whole(other).ids


def test_a_cut_is_never_before_a_normalized_added_token():
    # Normalized added tokens are matched after the specials are split out, so a special
    # that starts inside one can end past the text two prompts share.
    from tokenizers import AddedToken

    tok = byte_level()
    tok.add_tokens([AddedToken("<ab>", normalized=True)])
    tok.add_special_tokens([AddedToken("b>" + "z" * 12, normalized=False)])
    pt = prefix_tokens(tok, special=False)
    assert pt is not None
    whole, _ = encoders(tok, special=False)
    head = "You are a helpful assistant. " * 12 + "answer "
    pt.ids(head + "<ab>" + "z" * 10 + "q the end of the first")
    other = head + "<ab>" + "z" * 12 + " the second"
    assert pt.ids(other) == whole(other).ids
