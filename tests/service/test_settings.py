"""One table of settings (kvgen.service.settings.SETTINGS): every field of Settings and
EngineOptions is in it with a doc line, the README's table lists exactly these with the same
defaults, and only Settings.from_env reads the environment."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvgen.engine.options import EngineOptions
from kvgen.service.settings import SETTINGS, Settings

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `([A-Z0-9_]+)` \| (.*?) \| (.*) \|$")


def readme_settings() -> dict[str, str]:
    """{variable: default} from the README's `| Variable | Default | Meaning |` table."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Settings"):]
    table = section[section.index("| Variable | Default | Meaning |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        m = ROW.match(line)
        assert m, f"README settings row not understood: {line!r}"
        assert m.group(3).strip(), f"{m.group(1)} has no meaning in the README"
        rows[m.group(1)] = m.group(2)
    return rows


def test_readme_lists_exactly_the_settings_with_their_defaults():
    readme = readme_settings()
    code = {s.env: s.shown for s in SETTINGS}
    assert sorted(set(code) - set(readme)) == [], "settings missing from the README"
    assert sorted(set(readme) - set(code)) == [], "README rows that are no setting"
    assert {k: readme[k] for k in code} == code


def test_every_field_is_a_documented_setting():
    declared = {(s.owner, s.name) for s in SETTINGS}
    for cls in (Settings, EngineOptions):
        for f in fields(cls):
            if f.name != "engine":
                assert (cls, f.name) in declared
                assert f.metadata["doc"].strip() and "\n" not in f.metadata["doc"], f.name
    assert len({s.env for s in SETTINGS}) == len(SETTINGS)  # one name, one meaning
    for s in SETTINGS:
        assert s.kind in (str, int, float, bool), s.env
        assert isinstance(s.default, s.kind), s.env


def test_from_env_parses_each_kind():
    s = Settings.from_env({"PORT": "6000", "GRACE_S": "2.5", "CUDA_GRAPHS": "off", "KV_DTYPE": "fp8",
                           "TLS_CERT": "/x.pem", "MAX_BATCH_ENTRIES": "8", "KV_WARM_CODEC": "q4", "THREADS": ""})
    assert (s.port, s.grace_s, s.tls_cert, s.max_batch_entries) == (6000, 2.5, "/x.pem", 8)
    e = s.engine
    assert (e.cuda_graphs, e.kv_dtype, e.kv_warm_codec, e.threads) == (False, "fp8", "q4", 0)
    assert Settings.from_env({}) == Settings()
    with pytest.raises(ValueError, match="PORT"):
        Settings.from_env({"PORT": "many"})
    with pytest.raises(ValueError, match="CUDA_GRAPHS"):
        Settings.from_env({"CUDA_GRAPHS": "maybe"})


# Modules that may read the environment, and why: the one reader of settings, the OpenTelemetry
# SDK's own OTEL_* variables, and the CLI (a client program: its own KVGEN_TARGET / API_KEY defaults).
ENV_READERS = {"kvgen/service/settings.py", "kvgen/service/tracing.py", "kvgen/cli.py"}


def reads_environment(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv") for a in node.names):
            return True
    return False


def test_no_module_reads_the_environment_on_its_own():
    readers = {str(p.relative_to(ROOT)) for p in (ROOT / "kvgen").rglob("*.py") if reads_environment(p)}
    assert readers <= ENV_READERS, sorted(readers - ENV_READERS)
