"""Server settings, read from the environment (the Makefile passes them through)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from kvgen.engine.generator import EngineOptions


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
        for f in fields(cls):
            if f.name != "engine" and f.name.upper() in env and env[f.name.upper()] != "":
                setattr(s, f.name, type(getattr(s, f.name))(env[f.name.upper()]))
        for f in fields(EngineOptions):
            if f.name.upper() in env and env[f.name.upper()] != "":
                setattr(s.engine, f.name, type(getattr(s.engine, f.name))(env[f.name.upper()]))
        return s
