"""lm-eval, unmodified, against the OpenAI endpoint of a tiny-model server: local-completions
(generate_until, and multiple choice scored from echoed prompt logprobs, tokenized through the
server's /tokenize) and local-chat-completions, on a task kept in the repository (no dataset is
downloaded). The tiny model's answers are noise: what is checked is that every request of the
harness is served and scored."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[3]
TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
VENV = ROOT / ".venv-lmeval"
DOCS = 6  # lines of kvgen_tiny.jsonl


@pytest.fixture(scope="module")
def lm_eval() -> Path:
    """The lm_eval command, from its own venv (`make lmeval-env` installs it when missing)."""
    if not (VENV / ".installed").exists():
        p = subprocess.run(["make", "lmeval-env"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"make lmeval-env failed:\n{p.stdout}\n{p.stderr}"
    return VENV / "bin" / "lm_eval"


@pytest.fixture(scope="module")
def eval_server(start_server):
    return start_server(http_port=free_port())


def run(lm_eval: Path, model: str, url: str, tasks: str, out: Path, *extra: str) -> dict:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    cmd = [str(lm_eval), "run", "--model", model, "--model_args",
           f"model=tiny-llama,base_url={url},num_concurrent=2,max_retries=1", "--tasks", tasks, "--include_path",
           ".", "--output_path", str(out), "--log_samples", *extra]
    p = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)  # data_files: here
    assert p.returncode == 0, f"lm_eval failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    (results,) = out.rglob("results_*.json")
    return json.loads(results.read_text())


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_local_completions(lm_eval, eval_server, tmp_path):
    url = f"http://127.0.0.1:{eval_server.server.http.port}/v1/completions"
    r = run(lm_eval, "local-completions", url, "kvgen_tiny_gen,kvgen_tiny_mc", tmp_path)
    assert 0 <= r["results"]["kvgen_tiny_gen"]["exact_match,none"] <= 1
    assert 0 <= r["results"]["kvgen_tiny_mc"]["acc,none"] <= 1
    assert r["n-samples"]["kvgen_tiny_gen"]["effective"] == r["n-samples"]["kvgen_tiny_mc"]["effective"] == DOCS
    for s in samples(tmp_path, "kvgen_tiny_mc"):  # four scored choices per question, each a real logprob
        scores = [float(resp[0][0]) for resp in s["resps"]]  # logged as text
        assert len(scores) == 4 and all(math.isfinite(x) and x < 0 for x in scores)
    assert all(isinstance(s["resps"][0][0], str) for s in samples(tmp_path, "kvgen_tiny_gen"))


def test_local_chat_completions(lm_eval, eval_server, tmp_path):
    url = f"http://127.0.0.1:{eval_server.server.http.port}/v1/chat/completions"
    r = run(lm_eval, "local-chat-completions", url, "kvgen_tiny_gen", tmp_path, "--apply_chat_template")
    assert 0 <= r["results"]["kvgen_tiny_gen"]["exact_match,none"] <= 1
    assert r["n-samples"]["kvgen_tiny_gen"]["effective"] == DOCS
