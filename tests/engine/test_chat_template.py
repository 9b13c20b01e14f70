"""A chat template renders as transformers renders it (its apply_chat_template on the same template and
messages), for what templates on the Hub use beyond plain jinja2: `{% break %}` / `{% continue %}`,
`{% generation %}` blocks, tojson (JSON as json.dumps writes it: jinja2's own escapes HTML characters),
namespace(), raise_exception, tools and documents given as none."""

from __future__ import annotations

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from kvgen.engine.tokenizer import TextTokenizer
from tests.tiny import tiny_bpe_tokenizer

TEMPLATE = (
    "{%- if tools is not none or documents is not none -%}{{ raise_exception('no tools were given') }}{%- endif -%}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}{%- continue -%}{%- endif -%}"
    "{%- if m['content'] == 'STOP' -%}{%- break -%}{%- endif -%}"
    "<|{{ m['role'] }}|>{{ ns.system }}"
    "{%- if m['role'] == 'assistant' -%}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{%- else -%}{{ m['content'] }} {{ m | tojson }} {{ m['meta'] | default({}) | tojson(indent=2) }}{%- endif -%}"
    "{{ eos_token }}\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
    "{%- if messages | length > 6 -%}{{ raise_exception('too many messages') }}{%- endif -%}")

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<b>tags</b> & 'quotes' café 日本"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again", "meta": {"k": ["é", 1]}}],
    [{"role": "user", "content": "first"}, {"role": "user", "content": "STOP"}, {"role": "user", "content": "never"}],
]


@pytest.fixture(scope="module")
def pair():
    tok = tiny_bpe_tokenizer(300)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    hf.chat_template = TEMPLATE
    ours = TextTokenizer(tok, TEMPLATE, tok.token_to_id("<|endoftext|>"), False, set(), eos_token="<|im_end|>")
    return ours, hf


@pytest.mark.parametrize("chat", CHATS, ids=["plain", "json", "break"])
def test_templates_render_as_transformers_renders_them(pair, chat):
    ours, hf = pair
    for prompt in (True, False):
        want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == want


def test_a_template_that_raises_says_why(pair):
    ours, _ = pair
    with pytest.raises(jinja2.exceptions.TemplateError, match="too many messages"):
        ours.apply_chat_template([{"role": "user", "content": "x"}] * 7)


def test_a_template_that_does_not_compile_refuses_chats_and_the_model_serves_prompts(caplog):
    tok = tiny_bpe_tokenizer(300)
    with caplog.at_level("WARNING", logger="kvgen"):
        ours = TextTokenizer(tok, "{% for m in messages %}{{ m['content'] }}", None, False, set())
    assert "does not compile" in caplog.text and not ours.renders_chats  # GetModelInfo.has_chat_template: false
    assert ours.encode("hello") == tok.encode("hello").ids
    with pytest.raises(ValueError, match="chat template does not compile .*send a prompt instead"):
        ours.encode_chat([{"role": "user", "content": "hi"}])


def test_a_folders_named_templates_render_the_default_as_transformers_does(tmp_path):
    """tokenizer_config.json may hold a list of named templates (a tool-use one beside the default)."""
    import json

    from transformers import AutoTokenizer

    tiny_bpe_tokenizer(300).save(str(tmp_path / "tokenizer.json"))
    named = [{"name": "tool_use", "template": "TOOLS{{ messages | length }}"},
             {"name": "default", "template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": named, "eos_token": "<|im_end|>"}))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    want = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(chat, tokenize=False)
    assert want == "<user>hi<assistant>yo"
    assert TextTokenizer.from_folder(tmp_path).apply_chat_template(chat, add_generation_prompt=False) == want
