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


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a token is that token, whatever the merges would make of it
    add_bos: bool = False  # llama.cpp's default where the file does not say (tokenizer.ggml.add_bos_token)


_KINDS = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
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
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    "seed-coder": PreTokenizer((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                                r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    # llama.cpp made the tokenizer.json's possessive quantifiers greedy: its reading is the one served
    "bailingmoe": PreTokenizer((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "finnish": PreTokenizer((_FINNISH,)),
    "viking": PreTokenizer((_FINNISH, r"\p{N}")),
}

# tokenizer.ggml.pre -> its kind, as llama-vocab.cpp's llama_vocab::impl::load groups the names
NAMES = {
    "default": "default",
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "gigachat",
                     "a.x-4.0", "mellum", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "modern-bert"], "gpt2"),
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
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
    "seed-coder": "seed-coder",
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], "bailingmoe"),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], "finnish"),
    "viking": "viking",
}


def of(pre: str | None) -> PreTokenizer:
    """The pre-tokenizer a file's tokenizer.ggml.pre names (a file without one: llama.cpp's "default")."""
    kind = NAMES.get(pre or "default")
    if kind is None:
        raise UnsupportedModel(f"unsupported BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre): its text splitting is not "
                         f"one kvgen implements, and another would give other token ids than the model's; "
                         f"supported: {', '.join(sorted(NAMES))}")
    return _KINDS[kind]


def splits(pre: PreTokenizer) -> list:
    """The pre-tokenizer's regexes as `tokenizers` Split steps, each cutting the pieces the last left
    and keeping what lies between matches as pieces of its own (llama.cpp's unicode_regex_split)."""
    return [pre_tokenizers.Split(Regex(r), "isolated") for r in pre.regexes]
