"""A byte-level BPE file's `tokenizer.ggml.pre` picks how text is cut into words, as llama.cpp reads it.

Against llama.cpp's own table (src/llama-vocab.cpp of the sources the converter comes from, parsed
here): every name llama.cpp knows (but "default", which no converter writes for a BPE vocabulary: GPT-2's split,
as transformers reads it) is either served with its regexes and flags or refused by name,
never split some other way; each served name cuts a battery of texts as llama.cpp's regexes do,
applied its way (each regex cutting the pieces the last left, Python's `regex` as the engine). Where
llama.cpp notes the model's own regex (tokenizer.json's) beside the one it adapted for C++'s
std::regex, the model's is the reference: the adapted ones differ from it on some non-ASCII capitals.
"""

from __future__ import annotations

import re

import gguf
import pytest
import regex

from kvgen.engine import pre_tokenizers
from kvgen.engine.model_config import UnsupportedModel
from kvgen.engine.tokenizer import TextTokenizer
from tests.tiny import tiny_bpe_tokenizer, tiny_config, tiny_weights, write_gguf

TEXTS = [
    "Hello world! It's 2024, and we've got 1234567 apples; I'M sure they'll last.",
    "HTTPServer parses XMLHttpRequest and ÉCOLE, École, naïve café, straße, ΑΘΗΝΑ and Αθήνα.",
    "def f(x):\n\treturn x**2  # ok\r\n\n\n   indented\n \n",
    "中文字符和日本語のカタカナ、한국어 텍스트。数字１２３ and ١٢٣ and ⅻ.",
    "emoji 👍🏽 🇫🇷 and ZWJ 👨‍👩‍👧, tabs\t\there, spaces     end   ",
    "!!!...??? ---> $100+<=>^~|` @user #tag [x] {y} \"quoted\" 'single' 3.14159 1,000,000",
    "   leading spaces, trailing newline\n",
    "",
]


def split(pre: pre_tokenizers.PreTokenizer, text: str) -> list[str]:
    from tokenizers import pre_tokenizers as hf

    return [piece for piece, _ in hf.Sequence(pre_tokenizers.splits(pre)).pre_tokenize_str(text)]


def test_the_digits_are_cut_as_each_family_was_trained():
    number = "in 2024: 1234567"
    assert split(pre_tokenizers.of("gpt-2"), number) == ["in", " 2024", ":", " 1234567"]
    assert split(pre_tokenizers.of("smollm"), number) == ["in", " ", "2", "0", "2", "4", ":", " ", *"1234567"]
    assert split(pre_tokenizers.of("llama-bpe"), number) == ["in", " ", "202", "4", ":", " ", "123", "456", "7"]
    for qwen in ("qwen2", "deepseek-r1-qwen"):  # DeepSeek-R1's Qwen distills keep Qwen's vocabulary and split
        assert split(pre_tokenizers.of(qwen), number) == ["in", " ", "2", "0", "2", "4", ":", " ", *"1234567"]
    assert split(pre_tokenizers.of("tekken"), "HTTPServer") == ["HTTPServer"]
    assert split(pre_tokenizers.of("gpt-4o"), "they'll HTTPServer") == ["they'll", " HTTPServer"]
    assert split(pre_tokenizers.of("llama-bpe"), "they'll") == ["they", "'ll"]


def test_a_file_without_a_name_is_cut_as_transformers_reads_it_and_an_unknown_name_is_refused(tmp_path):
    """No name, or "default": GPT-2's split, transformers' reading (llama.cpp's own "default" would cut
    "=12345" into "=", "123", "45")."""
    assert pre_tokenizers.of(None) is pre_tokenizers.of("default") is pre_tokenizers.of("gpt-2")
    assert split(pre_tokenizers.of(None), "a+b=12345") == ["a", "+", "b", "=", "12345"]
    tok = tiny_bpe_tokenizer(300)
    cfg = tiny_config(vocab=tok.get_vocab_size(), layers=1, hidden=32, heads=2, kv_heads=1, ffn=64)
    weights = tiny_weights(cfg, seed=1)
    for name in ("kimi-k2", "gemma4", "some-new-model"):
        path = tmp_path / f"{name}.gguf"
        write_gguf(path, cfg, weights, tok, pre=name)
        with pytest.raises(UnsupportedModel, match=f"unsupported BPE pre-tokenizer '{name}'"):
            TextTokenizer.from_gguf(gguf.GGUFReader(path))


def test_llama_3_and_tekken_files_skip_merges_for_whole_words_and_take_bos_unless_told(tmp_path):
    """ignore_merges: a word that is a token encodes as that token, though the merges would not make it;
    BOS where the file does not say (this one says no)."""
    tok = tiny_bpe_tokenizer(300)
    cfg = tiny_config(vocab=tok.get_vocab_size(), layers=1, hidden=32, heads=2, kv_heads=1, ffn=64)
    cfg.bos_token_id = 1
    weights = tiny_weights(cfg, seed=1)
    for name, llama_cpps in (("llama-bpe", True), ("tekken", True), ("qwen2", False), ("gpt-2", False)):
        path = tmp_path / f"{name}.gguf"
        write_gguf(path, cfg, weights, tok, pre=name)
        ours = TextTokenizer.from_gguf(gguf.GGUFReader(path))
        assert ours.tok.model.ignore_merges == pre_tokenizers.of(name).add_bos == llama_cpps
        assert not ours.add_bos  # the file says (write_gguf: add_bos_token false)


# --- llama.cpp's table, from its source ---

def _c_string(literal: str) -> str:
    """A C++ string literal's text: its escapes undone, its UTF-8 (read as text) kept."""
    return literal.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _literals(block: str) -> list[str]:
    return [_c_string(m) for m in re.findall(r'"((?:[^"\\]|\\.)*)"', block)]


@pytest.fixture(scope="module")
def llama_cpp_table():
    """{name: (kind, ignore_merges, add_bos)} and {kind: regexes}, from llama-vocab.cpp."""
    from tests.tiny import llama_cpp_sources

    src = (llama_cpp_sources() / "src" / "llama-vocab.cpp").read_text()
    names = {}
    for cond, body in re.findall(r'if \(\s*((?:tokenizer_pre == "[^"]+"\s*\|\|\s*)*tokenizer_pre == "[^"]+")\s*\)'
                                 r'\s*\{(.*?)\}', src, re.S):
        kind = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", body)
        if kind:
            for name in re.findall(r'"([^"]+)"', cond):
                names[name] = (kind.group(1), "ignore_merges = true" in body, "add_bos = true" in body)
    ctor = src[src.index("struct llm_tokenizer_bpe : llm_tokenizer"):src.index("struct llm_tokenizer_bpe_session")]
    regexes = {}
    for cases, body in re.findall(r"((?:case LLAMA_VOCAB_PRE_TYPE_\w+:\s*)+)(.*?)break;", ctor, re.S):
        if "regex_exprs = {" not in body:
            continue
        exprs = body[body.index("regex_exprs = {"):body.index("};")]
        original = [line.split("//", 1)[1] for line in body.split("\n") if re.match(r'\s*//\s*"', line)]
        active = [line for line in exprs.split("\n") if re.match(r'\s*"', line)]
        chosen = _literals("\n".join(original if original and "possessive" not in body else active))
        for kind in re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", cases):
            regexes[kind] = (chosen, "byte_encode = false" in body)
    default = ctor[ctor.rindex("default:"):]
    regexes["DEFAULT"] = (_literals(default[default.index("regex_exprs = {"):default.index("};")]), False)
    return names, regexes


def reference_split(exprs: list[str], text: str) -> list[str]:
    pieces = [text] if text else []
    for expr in exprs:
        cut = []
        for piece in pieces:
            at = 0
            for m in regex.finditer(expr, piece):
                if m.start() > at:
                    cut.append(piece[at:m.start()])
                if m.end() > m.start():
                    cut.append(m.group())
                at = max(at, m.end())
            if at < len(piece):
                cut.append(piece[at:])
        pieces = cut
    return pieces


@pytest.mark.heavy  # llama.cpp's sources: fetched once a machine (`make converter`), not by `make test-fast`
def test_every_name_llama_cpp_knows_is_served_as_it_reads_it_or_refused(llama_cpp_table):
    names, regexes = llama_cpp_table
    assert len(names) > 60 and {"llama-bpe", "qwen2", "smollm", "tekken", "deepseek-r1-qwen"} <= set(names)
    assert set(pre_tokenizers.NAMES) <= set(names)  # no name of our own
    for name, (kind, ignore_merges, add_bos) in sorted(names.items()):
        if name == "default":  # the one name read as transformers reads it (pre_tokenizers.NAMES says why)
            kind = "GPT2"
        if name not in pre_tokenizers.NAMES:
            with pytest.raises(UnsupportedModel, match=re.escape(repr(name))):
                pre_tokenizers.of(name)
            continue
        ours = pre_tokenizers.of(name)
        exprs, raw_utf8 = regexes[kind]
        assert not raw_utf8, f"{name}: llama.cpp cuts it as SPM-style BPE, which kvgen does not"
        assert (ours.ignore_merges, ours.add_bos) == (ignore_merges, add_bos), name
        for text in TEXTS:
            assert split(ours, text) == reference_split(exprs, text), (name, text)
