"""Server settings: one table (SETTINGS) built from the fields of Settings and EngineOptions, each
with its environment name, type, default and one line of meaning. Settings.from_env is the only
reader of the environment (the OpenTelemetry SDK reads its own OTEL_* variables; kvgen/cpu/features.py
reads CPU_ACTIVATIONS as well, when kvgen.cpu is imported: the kernels are built for it before any
Settings exist, and Generator checks that the two agree).

`python -m kvgen.service.settings` prints the table as docs/settings.md shows it (settings_markdown);
`python -m kvgen.service.settings --update docs/settings.md` rewrites that part of the file."""

from __future__ import annotations

import os
import sys
import textwrap
from dataclasses import dataclass, field, fields

from kvgen.engine.options import EngineOptions, setting

MiB = 1 << 20


@dataclass(slots=True)
class Settings:
    host: str = setting("0.0.0.0", "listen address")
    port: int = setting(50051, "gRPC port")
    metrics_port: int = setting(9464, "Prometheus /metrics port (0 = off)")
    http_port: int = setting(0, "OpenAI-compatible HTTP API port: /v1/chat/completions, /v1/completions, "
                                "/v1/models (0 = off)")
    model: str = setting("", "a GGUF file or a Hugging Face folder (empty: the embedded model)",
                         shown="embedded SmolLM2")
    grace_s: float = setting(10.0, "how long in-flight streams may finish on SIGTERM")
    drain_delay_s: float = setting(0.0, "on SIGTERM, how long to answer NOT_SERVING while still serving calls "
                                   "before the server stops taking them, so a proxy's health check moves traffic "
                                   "away first")
    api_key: str = setting("", "when set, calls need `authorization: Bearer <key>` metadata; several keys, "
                               "comma-separated, give tenants their own", shown="(none)")
    admin_api_keys: str = setting("", "with API_KEY set, the keys (comma-separated, each one of API_KEY's) that may "
                                      "load and unload LoRA adapters (LoadAdapter, /v1/load_lora_adapter); none: "
                                      "no caller may", shown="(none)")
    tls_cert: str = setting("", "PEM certificate chain file; with TLS_KEY the server speaks TLS only", shown="(none)")
    tls_key: str = setting("", "PEM private key file of TLS_CERT", shown="(none)")
    tls_client_ca: str = setting("", "PEM CA file; when set, clients must present a certificate it signed (mTLS)",
                                 shown="(none)")
    max_receive_bytes: int = setting(4 * MiB, "largest request message; bigger ones get RESOURCE_EXHAUSTED")
    max_send_bytes: int = setting(64 * MiB, "largest response message (a BatchGenerate reply with logprobs is big)")
    keepalive_time_s: float = setting(60.0, "ping a connection after this long without activity")
    keepalive_timeout_s: float = setting(20.0, "close a connection whose ping is unanswered this long")
    keepalive_min_ping_s: float = setting(10.0, "the shortest interval at which clients may send keepalive pings")
    max_connection_age_s: float = setting(0.0, "close connections after this long, so a mesh rebalances them "
                                                "(0: never)")
    max_connection_age_grace_s: float = setting(30.0, "how long calls on an aged connection may still finish")
    max_prompt_bytes: int = setting(256 * 1024, "largest prompt (or all messages together) in bytes, checked before "
                                                "tokenizing")
    max_batch_entries: int = setting(64, "most requests in one BatchGenerate")
    replica_id: str = setting("", "this server's name in GetLoad and in each response's x-kvgen-replica trailer "
                                  "(empty: host name and port)", shown="host:port")
    liveness_stall_s: float = setting(30.0, "liveness turns NOT_SERVING when the engine makes no progress on pending "
                                            "work for this long")
    engine: EngineOptions = field(default_factory=EngineOptions)

    @classmethod
    def from_env(cls, env=os.environ) -> Settings:
        s = cls()
        for item in SETTINGS:
            raw = env.get(item.env, "")
            if raw != "":
                target = s.engine if item.owner is EngineOptions else s
                try:
                    setattr(target, item.name, _parse(raw, item.kind))
                except ValueError as e:
                    raise ValueError(f"{item.env}={raw!r}: {e}") from None
        return s


@dataclass(frozen=True, slots=True)
class Setting:
    env: str  # the environment variable
    name: str  # the field on owner
    owner: type  # Settings or EngineOptions
    kind: type  # str, int, float or bool
    default: object
    doc: str
    shown: str  # the default as docs/settings.md writes it


def _table(cls: type) -> list[Setting]:
    out = []
    for f in fields(cls):
        if f.name == "engine":
            continue
        if "doc" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(default, doc)")
        out.append(Setting(f.name.upper(), f.name, cls, type(f.default), f.default, f.metadata["doc"],
                           f.metadata.get("shown", _show(f.default))))
    return out


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _parse(raw: str, kind: type):
    if kind is bool:  # bool("0") is True
        if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"expected a boolean, got {raw!r}")
        return raw.lower() in ("1", "true", "yes", "on")
    return kind(raw)


SETTINGS: list[Setting] = _table(Settings) + _table(EngineOptions)


# docs/settings.md's generated part lies between these lines
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"
WIDTH = 120  # the docs' longest line (tests/test_docs.py)


def settings_markdown() -> str:
    """SETTINGS as Markdown, as docs/settings.md holds it between BEGIN and END: a list item a
    setting (its name, type, default and line of meaning), wrapped at WIDTH characters, which a
    table's one line a row could not be; the server's settings first, then the engine's."""
    out = []
    for owner, title in ((Settings, "The server (`Settings`, kvgen/service/settings.py)"),
                         (EngineOptions, "The engine (`EngineOptions`, kvgen/engine/options.py)")):
        out += [f"### {title}", ""]
        for s in SETTINGS:
            if s.owner is owner:
                out += textwrap.wrap(f"- `{s.env}` ({s.kind.__name__}; default: {s.shown}): {s.doc}", WIDTH,
                                     subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
        out.append("")
    return "\n".join(out)


def with_settings(text: str) -> str:
    """A document's text with its part between BEGIN and END replaced by settings_markdown()."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"no {BEGIN} ... {END} region")
    return f"{head}{BEGIN}\n{settings_markdown()}{END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--update"] and len(sys.argv) == 3:
        with open(sys.argv[2]) as f:
            text = f.read()
        with open(sys.argv[2], "w") as f:
            f.write(with_settings(text))
    elif len(sys.argv) == 1:
        print(settings_markdown(), end="")
    else:
        sys.exit("usage: python -m kvgen.service.settings [--update docs/settings.md]")
