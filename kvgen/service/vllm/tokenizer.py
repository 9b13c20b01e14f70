"""GetTokenizer's bundle: the files a gateway builds the model's tokenizer from (tokenizer.json,
tokenizer_config.json with the chat template, config.json, generation_config.json), zipped, with
the archive's SHA-256. The engine's tokenizer is written out as it runs, whatever it came from:
a GGUF's embedded one becomes a tokenizer.json that encodes exactly as the server does (its
pre-tokenizer follows the GGUF's `tokenizer.ggml.pre`, which transformers' own GGUF import does
not), so the gateway's token ids are the ones the server would have made."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

CHUNK_BYTES = 64 * 1024  # per GetTokenizerChunk: vLLM's servicer's size, within any message limit
# the model families' class names in transformers (config.json's `architectures`)
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def tokenizer_files(gen) -> dict[str, str]:
    tok, cfg = gen.tokenizer, gen.cfg

    def text(token_id):
        return tok.tok.id_to_token(token_id) if token_id is not None else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.context_length,
        "bos_token": text(tok.bos_id),
        "eos_token": tok.eos_token or None,
        "add_bos_token": bool(tok.add_bos and tok.bos_id is not None),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if tok.chat_template:
        tokenizer_config["chat_template"] = tok.chat_template
    eos = list(cfg.eos_token_ids)
    config = {"architectures": architectures(cfg), "model_type": cfg.architecture,
              "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.context_length,
              "bos_token_id": cfg.bos_token_id, "eos_token_id": eos}
    return {
        "tokenizer.json": tok.tok.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2),
        "config.json": json.dumps(config, indent=2),
        "generation_config.json": json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": eos}, indent=2),
    }


def architectures(cfg) -> list[str]:
    return [HF_ARCHITECTURES.get(cfg.architecture, cfg.architecture)]


def bundle(gen) -> tuple[bytes, str]:
    """The zip's bytes and their SHA-256 hex digest (files written in a fixed order and time,
    so the same tokenizer always gives the same digest)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, body in tokenizer_files(gen).items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), body, zipfile.ZIP_DEFLATED)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str):
    """(bytes, sha256) per chunk: the digest on the last one only, as the proto says."""
    for start in range(0, len(data), CHUNK_BYTES):
        last = start + CHUNK_BYTES >= len(data)
        yield data[start:start + CHUNK_BYTES], sha256 if last else ""
