"""How a byte-level BPE vocabulary (GGUF `tokenizer.ggml.model` "gpt2") cuts text into words before
its merges: by the file's `tokenizer.ggml.pre`, the name llama.cpp's converter gives the model's
pre-tokenizer, as llama.cpp reads it (src/llama-vocab.cpp: each name's regexes, applied one after
another, each cutting the pieces the last left; and whether a word that is itself a token skips the
merges). A name this table does not hold is refused (UnsupportedModel: the server does not start), as
llama.cpp refuses it: a wrong split gives other token ids than the model was trained on, silently.

The regexes are the models' own (their tokenizer.json's, where llama.cpp notes the one it adapted for
C++'s std::regex), for the `tokenizers` library's Oniguruma engine; tests/engine/test_pre_tokenizers.py
checks each name against llama.cpp's source.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

from kvgen.engine.model_config import UnsupportedModel

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _cased_words(suffix: str) -> str:
    """A word's capitals, then its lower case: Tekken's and o200k's words ("camelCase" -> "camel", "Case")."""
    upper, lower, lead = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{upper}*{lower}+{suffix}|{lead}{upper}+{lower}*{suffix}"


TEKKEN = _cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT4O = _cased_words(_CONTRACTIONS + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
DEEPSEEK3_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                   r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_FINNISH = r" ?[^(\s|.,!?…。，、।۔،)]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # DeepSeek's (LLM and Coder) runs of CJK and Hangul
# DeepSeek LLM's letters, as llama.cpp lists them (Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, Glagolitic,
# Coptic, fullwidth Latin, ...): cased letters, not \p{L}: CJK and Hangul are cut apart by their own regex
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
    "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-"
    "\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113"
    "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-"
    "\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0"
    "-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a token is that token, whatever the merges would make of it
    add_bos: bool = False  # llama.cpp's default where the file does not say (tokenizer.ggml.add_bos_token)


_KINDS = {
    "gpt2": PreTokenizer((GPT2,)),
    "digits": PreTokenizer((r"\p{N}", GPT2)),
    "llama3": PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True),
    "llama3-merges": PreTokenizer((LLAMA3,)),
    "qwen2": PreTokenizer((QWEN2,)),
    "qwen35": PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                            r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "tekken": PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True),
    "gpt4o": PreTokenizer((GPT4O,)),
    "deepseek3": PreTokenizer((r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3_WORDS)),
    "deepseek-llm": PreTokenizer(("[\r\n]", _DEEPSEEK_LETTERS,
                                  "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
                                  _CJK_HANGUL, r"\p{N}+")),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    "seed-coder": PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                                r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    # llama.cpp made the tokenizer.json's possessive quantifiers greedy: its reading is the one served
    "bailingmoe": PreTokenizer((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "finnish": PreTokenizer((_FINNISH,)),
    "viking": PreTokenizer((_FINNISH, r"\p{N}")),
}

# tokenizer.ggml.pre -> its kind, as llama-vocab.cpp's llama_vocab::impl::load groups the names; but "default" (or
# no name) is GPT-2's split, as transformers reads such a file: llama.cpp's "default" is four legacy regexes of its
# own (punctuation runs and 3-digit groups cut first) that no converter writes for a BPE vocabulary, so it is only
# ever a hand-made file's, whose vocabulary was most likely trained with GPT-2's split
NAMES = {
    **dict.fromkeys(["default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
                     "gigachat", "a.x-4.0", "mellum", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "modern-bert"],
                    "gpt2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"],
                    "digits"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"], "llama3"),
    **dict.fromkeys(["dbrx", "smaug-bpe"], "llama3-merges"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
                     "grok-2"], "qwen2"),
    "qwen35": "qwen35",
    "tekken": "tekken",
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt4o"),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], "deepseek3"),
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
    "seed-coder": "seed-coder",
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], "bailingmoe"),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], "finnish"),
    "viking": "viking",
}


def of(pre: str | None) -> PreTokenizer:
    """The pre-tokenizer a file's tokenizer.ggml.pre names (a file without one: "default")."""
    kind = NAMES.get(pre or "default")
    if kind is None:
        raise UnsupportedModel(f"unsupported BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre): its text splitting is "
                               f"not one kvgen implements, and another would give other token ids than the model's; "
                               f"supported: {', '.join(sorted(NAMES))}")
    return _KINDS[kind]


def splits(pre: PreTokenizer) -> list:
    """The pre-tokenizer's regexes as `tokenizers` Split steps, each cutting the pieces the last left
    and keeping what lies between matches as pieces of its own (llama.cpp's unicode_regex_split)."""
    return [pre_tokenizers.Split(Regex(r), "isolated") for r in pre.regexes]
