"""Server settings, read from the environment (the Makefile passes them through)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from kvgen.engine.options import EngineOptions


@dataclass(slots=True)
class Settings:
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 9464  # 0 = no /metrics endpoint
    model: str = ""  # GGUF file or HF folder; empty = the embedded model
    grace_s: float = 10.0  # how long in-flight streams may finish on SIGTERM
    api_key: str = ""  # when set, calls need `authorization: Bearer <key>`
    engine: EngineOptions = field(default_factory=EngineOptions)

    @classmethod
    def from_env(cls, env=os.environ) -> Settings:
        s = cls()
        for target, names in ((s, [f.name for f in fields(cls) if f.name != "engine"]),
                              (s.engine, [f.name for f in fields(EngineOptions)])):
            for name in names:
                raw = env.get(name.upper(), "")
                if raw != "":
                    setattr(target, name, _parse(raw, type(getattr(target, name))))
        return s


def _parse(raw: str, kind: type):
    if kind is bool:  # bool("0") is True
        if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"expected a boolean, got {raw!r}")
        return raw.lower() in ("1", "true", "yes", "on")
    return kind(raw)
