"""GetModelInfo names the family and its attention layout over real gRPC: per layer its sliding window,
the attention score and final logit soft-caps, and which code computes a decode step and why not a faster
one. Read through the Python client's ModelInfo, which must carry each field the server sets.

A tiny Gemma 2 (tests/tiny.py: windowed and global layers alternating, scores capped at 1.5, logits at 5)
takes torch attention, which the fused step and the CUDA kernels do not replace (neither windows nor caps);
the embedded SmolLM2 at WEIGHT_DTYPE auto takes the fused CPU step, and torch attention once an
ATTENTION_WINDOW asks for a window the fused step does not mask, or at fp32 weights (the step multiplies
GGUF blocks only)."""

from __future__ import annotations

import logging
import os

import pytest

from kvgen.client import Client
from kvgen.engine.generator import Generator, load_model
from kvgen.engine.options import EngineOptions
from tests.conftest import ServerThread
from tests.tiny import smollm2_hf_tokenizer, write_family_folder


def _info(gen: Generator):
    s = ServerThread(gen)
    try:
        with s.channel() as ch:
            return Client(channel=ch).model_info(timeout=30)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def gemma2_folder(tmp_path_factory):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = tmp_path_factory.mktemp("gemma2")
    write_family_folder(folder, "gemma2", smollm2_hf_tokenizer(), seed=3)
    return folder


def test_gemma2_says_its_windows_caps_and_torch_path(gemma2_folder):
    info = _info(Generator(*load_model(str(gemma2_folder), "fp32"), EngineOptions()))
    assert info.architecture == "gemma2" and info.num_layers == 4 and info.attention_layout == "attention"
    assert info.layer_windows == (8, 0, 8, 0)  # windowed first, then alternating with global layers
    assert info.attention_logit_softcap == 1.5 and info.final_logit_softcap == 5.0
    assert info.decode_path == "torch"
    assert "per-layer sliding windows [8]" in info.decode_path_reason
    assert "soft-capping at 1.5" in info.decode_path_reason


def test_the_embedded_llama_says_which_decode_path_and_why(embedded, embedded_fp32, caplog):
    blocks = embedded  # the GGUF's own blocks (the default): what the fused step multiplies
    with caplog.at_level(logging.INFO, logger="kvgen"):
        info = _info(Generator(*blocks, EngineOptions()))
    assert "decode steps run the fused step" in caplog.text  # the start log says the path, as GetModelInfo
    assert info.architecture == "llama" and info.weight_dtype == "gguf"
    assert info.layer_windows == (0,) * info.num_layers
    assert info.attention_logit_softcap == info.final_logit_softcap == 0.0
    assert (info.decode_path, info.decode_path_reason) == ("fused", "")
    windowed = _info(Generator(*blocks, EngineOptions(attention_window=16)))
    assert windowed.layer_windows == (16,) * info.num_layers
    assert windowed.decode_path == "torch" and windowed.decode_path_reason.startswith("attention window 16")
    fp32 = _info(Generator(*embedded_fp32, EngineOptions()))  # WEIGHT_DTYPE=fp32
    assert fp32.decode_path == "torch" and fp32.decode_path_reason.startswith("weights fp32")
