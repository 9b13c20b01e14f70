"""A model of a family kvgen does not run: the server process says so in one line and exits non-zero,
as a new user meets it (an HF folder that transformers wrote, a GGUF; gRPC and HTTP ports configured)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgen.engine import model_files
from tests.conftest import free_port
from tests.tiny import tiny_bpe_tokenizer, tiny_config, tiny_weights, write_gguf

ROOT = Path(__file__).resolve().parents[2]


def serve(model: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MODEL": str(model), "PORT": str(free_port()), "HTTP_PORT": str(free_port()),
           "METRICS_PORT": str(free_port())}
    return subprocess.run([sys.executable, "-m", "kvgen.service.server"], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)


def gpt2_folder(tmp_path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(folder)
    return folder


def falcon_gguf(tmp_path: Path) -> Path:
    cfg = tiny_config(vocab=300)
    path = tmp_path / "falcon.gguf"
    write_gguf(path, cfg, tiny_weights(cfg), tiny_bpe_tokenizer(), arch="falcon")
    return path


@pytest.mark.parametrize(("make", "family"), [(gpt2_folder, "'gpt2'"), (falcon_gguf, "'falcon'")])
def test_unsupported_family_is_refused_in_one_line_with_a_non_zero_exit(tmp_path, make, family):
    out = serve(make(tmp_path))
    assert out.returncode == 2, out.stdout
    errors = [line for line in out.stdout.splitlines() if " ERROR " in line]
    assert len(errors) == 1, out.stdout
    assert family in errors[0] and ", ".join(model_files.SUPPORTED_ARCHS) in errors[0], errors[0]
    # nothing else after the one line: no traceback, no grpc shutdown on a closed loop
    assert out.stdout.rstrip().endswith(errors[0]), out.stdout
    assert "Traceback" not in out.stdout and "Event loop is closed" not in out.stdout, out.stdout
