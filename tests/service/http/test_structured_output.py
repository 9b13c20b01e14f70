"""response_format through the openai SDK, on the embedded SmolLM2 (a random model would not end
its JSON): json_object and json_schema replies parse, and the schema's reply validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvgen.engine.generator import EngineOptions, Generator
from tests.conftest import ServerThread, free_port

from .conftest import sdk

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "country": {"type": "string", "maxLength": 24}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol(embedded):
    s = ServerThread(Generator(*embedded, EngineOptions(kv_cache_mb=64)), http_port=free_port())
    yield s
    s.stop()


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}},
], ids=["json_object", "json_schema"])
def test_response_format_replies_parse_as_json(smol, response_format):
    with sdk(smol) as c:
        r = c.chat.completions.create(model="kvgen", messages=[
            {"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON with keys city and country."}],
            max_tokens=48, temperature=0, response_format=response_format)
    value = json.loads(r.choices[0].message.content)
    assert isinstance(value, dict) and r.choices[0].finish_reason == "stop"
    if response_format["type"] == "json_schema":
        jsonschema.validate(value, SCHEMA)
