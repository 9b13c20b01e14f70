"""Our GGUF tokenizer against transformers' GGUF tokenizer, and incremental decoding."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen.engine.tokenizer import Detokenizer

CORPUS = [
    "Hello, world!",
    "  leading spaces and   runs of   whitespace\t\ttabs\n\n\nnewlines  ",
    "unicode: café naïve façade — “quotes” ‘single’ … ∑ ∫ √ π",
    "CJK 你好世界 こんにちは 안녕하세요 and emoji 🤖🚀👩‍💻 mixed",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n    pass\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "don't won't it's we'll they've I'm you'd",
    "Ελληνικά, русский язык, עברית, العربية",
    "snake_case camelCase SCREAMING_CASE kebab-case",
    "<|endoftext|>text after a special token",
]
DIGITS = ["The year 2024 had 366 days, ½ of them warm.", "pi = 3.14159, e = 2.71828", "call 555-0123 x42"]


def test_parity_with_transformers_gguf_tokenizer(embedded, hf_model):
    _, tok = embedded
    _, hf_tok = hf_model
    for text in CORPUS:
        assert tok.encode(text) == hf_tok(text, add_special_tokens=True).input_ids, text


def test_digits_are_split_as_the_model_was_trained(embedded, hf_model):
    # GGUF pre="smollm": llama.cpp isolates each digit before the GPT-2 split; transformers'
    # GGUF converter does not. Ours matches transformers once its pre-tokenizer does too.
    from tokenizers import Regex, pre_tokenizers

    _, tok = embedded
    _, hf_tok = hf_model
    backend = hf_tok.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"), backend.pre_tokenizer])
    try:
        for text in DIGITS + CORPUS:
            assert tok.encode(text) == hf_tok(text).input_ids, text
    finally:
        backend.pre_tokenizer = backend.pre_tokenizer[1] if hasattr(backend.pre_tokenizer, "__getitem__") else None
    for text in DIGITS:
        digit_tokens = [tok.token_text(t) for t in tok.encode(text) if re.search(r"\d", tok.token_text(t))]
        assert all(len(re.sub(r"\D", "", t)) == 1 for t in digit_tokens), digit_tokens


def test_round_trip(embedded):
    _, tok = embedded
    for text in CORPUS + DIGITS:
        assert tok.decode(tok.encode(text), skip_special=False) == text


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_incremental_detokenizer_never_splits_characters(embedded, text):
    _, tok = embedded
    ids = tok.encode(text)
    d = Detokenizer(tok, [])
    pieces = [d.add(i) for i in ids] + [d.flush()]
    full = tok.decode(ids)
    assert "".join(pieces) == full
    if "\ufffd" not in full:  # (a code point whose bytes the vocab lacks decodes as U+FFFD)
        assert all("\ufffd" not in p for p in pieces), pieces
