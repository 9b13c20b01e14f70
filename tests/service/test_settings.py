"""One table of settings (kvgen.service.settings.SETTINGS): every field of Settings and
EngineOptions is in it with a doc line, docs/settings.md lists exactly these with the same types
and defaults (its list is what settings_markdown renders, so it cannot drift), and only
Settings.from_env reads the environment."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from kvgen.engine.options import EngineOptions
from kvgen.service.settings import BEGIN, END, SETTINGS, Settings, settings_markdown, with_settings

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "settings.md"
ITEM = re.compile(r"^- `([A-Z0-9_]+)` \((str|int|float|bool); default: (.*?)\): (.*)$", re.S)


def generated() -> str:
    """The part of docs/settings.md between its settings markers."""
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"docs/settings.md needs one {BEGIN} ... {END}"
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)]


def doc_settings() -> dict[str, tuple[str, str]]:
    """{variable: (type, default)} from docs/settings.md's list: one item a setting, `- `NAME` (type;
    default: shown): meaning`, its continuation lines indented."""
    items: list[str] = []
    for line in generated().splitlines():
        if line.startswith("- "):
            items.append(line)
        elif line.startswith("  ") and items:
            items[-1] += " " + line.strip()
        else:
            assert not line.strip() or line.startswith("### "), f"docs/settings.md line not understood: {line!r}"
    rows = {}
    for item in items:
        m = ITEM.match(item)
        assert m, f"docs/settings.md item not understood: {item!r}"
        assert m.group(4).strip(), f"{m.group(1)} has no meaning in docs/settings.md"
        assert m.group(1) not in rows, f"{m.group(1)} is listed twice"
        rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_docs_list_exactly_the_settings_with_their_defaults():
    listed = doc_settings()
    code = {s.env: (s.kind.__name__, s.shown) for s in SETTINGS}
    assert sorted(set(code) - set(listed)) == [], "settings missing from docs/settings.md"
    assert sorted(set(listed) - set(code)) == [], "docs/settings.md items that are no setting"
    assert {k: listed[k] for k in code} == code


def test_docs_hold_what_the_code_renders():
    """docs/settings.md's list is settings_markdown(), as `python -m kvgen.service.settings --update
    docs/settings.md` writes it: run that after changing a setting."""
    assert DOC.read_text() == with_settings(DOC.read_text()), \
        "docs/settings.md is stale: run .venv/bin/python -m kvgen.service.settings --update docs/settings.md"
    assert generated() == "\n" + settings_markdown()


def test_the_module_prints_the_list():
    out = subprocess.run([sys.executable, "-m", "kvgen.service.settings"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out == settings_markdown()


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
# (kvgen/cpu/features.py reads CPU_ACTIVATIONS, a setting of EngineOptions too, itself: what the kernels compile
# to is fixed when kvgen.cpu is imported, before any Settings exist, as Numba reads NUMBA_CPU_FEATURES)
ENV_READERS = {"kvgen/service/settings.py", "kvgen/service/tracing.py", "kvgen/cli.py", "kvgen/cpu/features.py"}


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
