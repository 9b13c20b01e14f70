"""Loading and unloading LoRA adapters while the server runs, for both APIs: kvgen.v1's LoadAdapter /
UnloadAdapter and vLLM's POST /v1/load_lora_adapter / /v1/unload_lora_adapter (http/lora_routes.py).

Admin-only: with API_KEY set, only a key listed in ADMIN_API_KEYS may (a path on the server's disk is
read, and every tenant's requests may lose the adapter); without API keys the server trusts everyone,
these calls too. Each outcome is an Outcome, which either API turns into its own status."""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from kvgen.engine.generator import Generator
from kvgen.engine.lora import Adapter, AdapterError, AdapterExists, AdapterInUse, AdaptersUnsupported, TooManyAdapters
from kvgen.errors import InvalidRequest, NotFound
from kvgen.service.auth import AuthInterceptor

MAX_NAME_CHARS = 128
MAX_PATH_CHARS = 4096
DEFAULT_UNLOAD_TIMEOUT_S = 30.0
MAX_UNLOAD_TIMEOUT_S = 3600.0
# a name is a metric label value, a comma-separated list's item (vllm:lora_requests_info) and an
# OpenAI model id: no commas, '=' (LORA_ADAPTERS' syntax), spaces or control characters
_NAME = re.compile(r"[A-Za-z0-9._:/@+-]+")
NOT_ADMIN = "loading and unloading LoRA adapters takes an admin key (ADMIN_API_KEYS)"


def name_violations(name: str) -> list[tuple[str, str]]:
    if not name:
        return [("name", "is empty: an adapter needs a name")]
    if len(name) > MAX_NAME_CHARS:
        return [("name", f"is {len(name)} characters; at most {MAX_NAME_CHARS}")]
    if not _NAME.fullmatch(name):
        return [("name", "may hold only letters, digits and . _ : / @ + -")]
    return []


def check_load(name: str, path: str) -> None:
    bad = name_violations(name)
    if not path:
        bad.append(("path", "is empty: a PEFT folder or a .gguf file on the server"))
    elif len(path) > MAX_PATH_CHARS or "\x00" in path:
        bad.append(("path", f"is not a path (over {MAX_PATH_CHARS} characters, or a NUL in it)"))
    if bad:
        raise InvalidRequest(bad)


def check_unload(name: str, timeout_s: float) -> float:
    """The timeout to use (0: the default); raises InvalidRequest."""
    bad = name_violations(name)
    if not 0 <= timeout_s <= MAX_UNLOAD_TIMEOUT_S:  # NaN too
        bad.append(("timeout_seconds", f"must be in [0, {MAX_UNLOAD_TIMEOUT_S:g}]"))
    if bad:
        raise InvalidRequest(bad)
    return timeout_s or DEFAULT_UNLOAD_TIMEOUT_S


def is_admin(settings, metadata) -> bool:
    """metadata: (key, value) pairs, `authorization: Bearer <key>` among them."""
    if settings is None or not settings.api_key:
        return True
    return bool(settings.admin_api_keys.strip()) and AuthInterceptor(settings.admin_api_keys).allows(metadata)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A load's or unload's result: the adapter, or an error with the status each API answers."""

    adapter: Adapter | None = None
    code: grpc.StatusCode = grpc.StatusCode.OK
    http: int = 200
    message: str = ""


# exception -> (gRPC status, HTTP status: vLLM answers 400 for a bad or duplicate load, 404 for an unknown unload);
# a base model that takes no adapters (a Mamba-2) is the server's state, not the request's: FAILED_PRECONDITION
_STATUSES = ((AdaptersUnsupported, grpc.StatusCode.FAILED_PRECONDITION, 400),
             (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, 400),
             (AdapterError, grpc.StatusCode.INVALID_ARGUMENT, 400),
             (AdapterExists, grpc.StatusCode.ALREADY_EXISTS, 400),
             (TooManyAdapters, grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
             (AdapterInUse, grpc.StatusCode.FAILED_PRECONDITION, 409),
             (NotFound, grpc.StatusCode.NOT_FOUND, 404))


def _failed(e: Exception) -> Outcome:
    for kind, code, http in _STATUSES:
        if isinstance(e, kind):
            return Outcome(None, code, http, str(e))
    raise e


async def load(gen: Generator, name: str, path: str) -> Outcome:
    try:
        check_load(name, path)
        return Outcome(await gen.load_adapter(name, path))
    except Exception as e:
        return _failed(e)


async def unload(gen: Generator, name: str, timeout_s: float = 0.0) -> Outcome:
    try:
        return Outcome(await gen.unload_adapter(name, check_unload(name, timeout_s)))
    except Exception as e:
        return _failed(e)
