"""A GGUF's sentencepiece vocabulary (tokenizer.ggml.model "llama": Llama 2, Mistral 7B, Phi-3, Gemma)
read by kvgen, against sentencepiece itself on the model the GGUF was made from.

The GGUF is llama.cpp's own convert_hf_to_gguf.py's, from a tiny llama folder whose tokenizer is a
sentencepiece model trained here (tests/tiny.py: both run in the converter's venv, which has
sentencepiece; this one does not).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvgen.engine.tokenizer import Detokenizer, TextTokenizer
from tests.tiny import TINY_CORPUS, convert_to_gguf, converter_python, family_model, write_sentencepiece_model

TEXTS = [
    *TINY_CORPUS,
    "Hello world",
    " leading space, and  two   spaces",
    "line one\nline two\n\n\ttabbed",
    "naïve café, Zürich, 日本語, emoji 🙂 and ∑ symbols",  # pieces the tiny vocabulary lacks: byte fallback
    "12345678 + 9 = 12345687",
    "",
    "x",
]


def _sentencepiece(model_path, texts) -> dict:
    """sentencepiece's own ids and decoded text of each text, and its vocabulary size."""
    script = ("import json, sys, sentencepiece as spm\n"
              "sp = spm.SentencePieceProcessor(model_file=sys.argv[1])\n"
              "texts = json.loads(sys.argv[2])\n"
              "ids = [sp.encode(t) for t in texts]\n"
              "print(json.dumps({'size': sp.get_piece_size(), 'ids': ids, 'decoded': [sp.decode(i) for i in ids],"
              " 'bos': sp.bos_id(), 'eos': sp.eos_id()}))\n")
    out = subprocess.run([converter_python(), "-c", script, str(model_path), json.dumps(texts)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm-llama")
    write_sentencepiece_model(folder / "tokenizer.model")
    ref = _sentencepiece(folder / "tokenizer.model", TEXTS)
    family_model("llama", ref["size"]).save_pretrained(folder)  # config.json + weights for the converter
    path = convert_to_gguf(folder, tmp_path_factory.mktemp("gguf") / "spm-llama.gguf")
    return path, ref


def _tokenizer(path) -> TextTokenizer:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"  # the converter wrote sentencepiece
    return TextTokenizer.from_gguf(reader)


def test_ids_and_text_are_sentencepieces(spm_gguf):
    path, ref = spm_gguf
    tok = _tokenizer(path)
    for text, ids, decoded in zip(TEXTS, ref["ids"], ref["decoded"], strict=True):
        assert decoded == text  # (the oracle: an identity normalizer, as Llama's; nothing collapsed)
        assert tok.encode(text, add_bos=False) == ids, text
        assert tok.decode(ids) == text, text
    # the byte fallback was exercised: the emoji's four bytes are <0xXX> tokens
    pieces = [tok.tok.id_to_token(i) for i in ref["ids"][TEXTS.index(TEXTS[8])]]
    assert ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"] == [p for p in pieces if p in ("<0xF0>", "<0x9F>", "<0x99>",
                                                                                   "<0x82>")]


def test_bos_by_default_and_a_special_token_whole(spm_gguf):
    path, ref = spm_gguf
    tok = _tokenizer(path)
    assert tok.bos_id == ref["bos"] and tok.encode("Hello world")[0] == ref["bos"]
    # a control token in the text stays one token, and the text after it gets its own space prefix, as
    # llama.cpp's sentencepiece tokenizer does
    eos = tok.tok.id_to_token(ref["eos"])
    assert tok.encode(f"Hello{eos}world", add_bos=False) == [*tok.encode("Hello", add_bos=False), ref["eos"],
                                                               *tok.encode("world", add_bos=False)]


def test_streamed_text_equals_the_whole(spm_gguf):
    path, ref = spm_gguf
    tok = _tokenizer(path)
    ids = [i for text_ids in ref["ids"] for i in text_ids]
    det = Detokenizer(tok, [])
    streamed = "".join(det.add(i) for i in ids) + det.flush()
    assert streamed == tok.decode(ids)


def test_the_model_loads_and_generates(spm_gguf):
    from kvgen.engine.generator import load_model

    path, ref = spm_gguf
    model, tok = load_model(str(path), "auto", "cpu")
    assert model.cfg.vocab_size == ref["size"]
    assert tok.encode(TEXTS[0], add_bos=False) == ref["ids"][0]
