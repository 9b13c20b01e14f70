"""Tokenizer from GGUF metadata or tokenizer.json, plus the chat template.

A GGUF holds one of two vocabularies (`tokenizer.ggml.model`):
- "gpt2", byte-level BPE (Llama 3, Qwen, SmolLM, Mistral Nemo, Phi-4): the pre-tokenizer follows the
  model's `tokenizer.ggml.pre`, as llama.cpp does (pre_tokenizers.py): SmolLM ("smollm") isolates every
  digit before the GPT-2 split, which transformers' GGUF converter leaves out (so the two differ on
  multi-digit numbers; ours is the model's).
- "llama", sentencepiece (Llama 2, Mistral 7B, Phi-3, Gemma): pieces with scores, spaces written
  as U+2581, bytes outside the pieces as <0xXX> tokens. llama.cpp merges the adjacent pair whose
  joined piece scores highest, again and again; BPE over every (left, right) split of every piece,
  ranked by the joined piece's score, makes the same merges. A space is put before the text and
  after every special token where the file says so (`tokenizer.ggml.add_space_prefix`, default
  true), as llama.cpp does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jinja2
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers as hf_pre_tokenizers

from kvgen.engine import pre_tokenizers
from kvgen.engine.chat_template import compile_template

log = logging.getLogger("kvgen.engine")

# GGUF token types (gguf.TokenType)
_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6
_SPACE = "\u2581"  # sentencepiece's space

def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of every normal piece into two pieces, best joined score first (sentencepiece's
    merge order; ties: the shorter left part, then the earlier pieces, as transformers orders them)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] not in (_CONTROL, _BYTE, _UNKNOWN)}
    found = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], len(left), vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(found)]


def _sentencepiece(field, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = field("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk = field("tokenizer.ggml.unknown_token_id")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a piece listed twice: its first id, as llama.cpp's token_to_id
    tok = Tokenizer(models.BPE(vocab, _sentencepiece_merges(tokens, scores, types), fuse_unk=True,
                               byte_fallback=True, unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    spaces = [normalizers.Replace(" ", _SPACE)]
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), *spaces] if prefix else spaces)
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*decode, decoders.Strip(" ", 1, 0)] if prefix else decode)
    return tok


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: pre_tokenizers.PreTokenizer) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = hf_pre_tokenizers.Sequence(
        [*pre_tokenizers.splits(pre), hf_pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


class TextTokenizer:
    """encode / decode / chat template; ids are plain lists of ints."""

    def __init__(self, tok: Tokenizer, chat_template: str | None, bos_id: int | None, add_bos: bool,
                 special_ids: set[int], eos_token: str = ""):
        self.tok = tok
        self.eos_token = eos_token  # the text templates get as eos_token
        self.chat_template = chat_template
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.special_ids = special_ids
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        self._template_error = ""
        if chat_template:
            try:
                self._template = compile_template(chat_template)
            except jinja2.TemplateError as e:  # prompts still serve; each chat request is refused, saying why
                self._template_error = f"the model's chat template does not compile ({e})"
                log.warning("%s: chat requests will be refused; prompts are served", self._template_error)

    @property
    def renders_chats(self) -> bool:
        """Whether chat messages can be rendered: a template, and one that compiles (GetModelInfo.has_chat_template)."""
        return self._template is not None

    @classmethod
    def from_gguf(cls, reader) -> TextTokenizer:
        def field(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        model = field("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} (byte-level BPE 'gpt2' and "
                             "sentencepiece 'llama' only)")
        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = pre_tokenizers.of(field("tokenizer.ggml.pre")) if model == "gpt2" else None
        tok = (_byte_level_bpe(tokens, field("tokenizer.ggml.merges"), pre) if pre
               else _sentencepiece(field, tokens, types))
        special = [i for i, ty in enumerate(types) if ty in (_CONTROL, _USER_DEFINED)]
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        bos = field("tokenizer.ggml.bos_token_id")
        eos = field("tokenizer.ggml.eos_token_id")
        # a file that does not say gets BOS where llama.cpp gives it one: sentencepiece, and the BPE
        # pre-tokenizers it adds BOS for (Llama 3's, Tekken's)
        add_bos = field("tokenizer.ggml.add_bos_token", pre.add_bos if pre else True)
        return cls(tok, field("tokenizer.chat_template"), bos, bool(add_bos),
                   set(special), tokens[eos] if eos is not None else "")

    @classmethod
    def from_folder(cls, folder: Path) -> TextTokenizer:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates (a tool-use one beside the default): transformers
            template = {t.get("name"): t.get("template") for t in template}.get("default")  # takes the default
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        # tokenizer.json's post-processor already adds BOS where the model wants it.
        special = {t.id if hasattr(t, "id") else i for i, t in tok.get_added_tokens_decoder().items()
                   if t.special} if hasattr(tok, "get_added_tokens_decoder") else set()
        bos = cfg.get("bos_token")
        bos_id = tok.token_to_id(bos if isinstance(bos, str) else (bos or {}).get("content", "")) if bos else None
        eos = cfg.get("eos_token") or ""
        eos = eos if isinstance(eos, str) else eos.get("content", "")
        return cls(tok, template, bos_id, False, special, eos)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=True).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError(f"{self._template_error or 'the model has no chat template'}; send a prompt instead of "
                             "messages")
        bos = self.tok.id_to_token(self.bos_id) if self.bos_id is not None else ""
        # tools and documents none, as transformers passes them without any: "tools is not none" must be false
        return self._template.render(messages=messages, tools=None, documents=None, bos_token=bos,
                                     eos_token=self.eos_token, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template writes BOS itself when the model wants it.
        return self.encode(self.apply_chat_template(messages), add_bos=False)


class Detokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Decodes a short window (prefix_offset..end) rather than the whole sequence, as vLLM and
    TGI do, so each step costs O(1) and byte-level merges across tokens decode right.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset])
        text = dec(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            delta = text[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character decodes as U+FFFD)."""
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset])
        text = dec(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
