"""The package's layering, read from the source: no module imports a layer above its own, and
the import graph has no cycle. Layers, bottom up:

    errors                          leaf: imports nothing of kvgen's
    cpu, gpu                        the backends: kernels and their references; neither knows the
                                    engine, nor the other backend
    engine/kv                       blocks, formats, tiers, the KV manager; no engine module
    engine (model, scheduler, ...)  the engine proper; never the API modules
    engine API                      generator, session, request, bridge (what callers use)
    service                         the gRPC server; the only layer that imports kvgen.v1
    client, cli                     talk to a server over gRPC only
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API = {"kvgen.engine.generator", "kvgen.engine.session", "kvgen.engine.request", "kvgen.engine.bridge"}


# Each folder (package) of kvgen and its layer; a module is in the layer of the deepest folder
# that holds it. The engine's API modules sit one above the rest of the engine's folder.
FOLDERS = {("errors",): 0, ("cpu",): 1, ("gpu",): 1, ("engine", "kv"): 2, ("engine",): 3, ("service",): 5, ("v1",): 5}
ENGINE_API = 4


def layer(mod: str) -> int:
    if mod in API:
        return ENGINE_API
    parts = tuple(mod.split(".")[1:])
    held = [folder for folder in FOLDERS if parts[:len(folder)] == folder]
    return FOLDERS[max(held, key=len)] if held else 6  # kvgen.client, kvgen.cli, kvgen itself


def modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "kvgen").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if not name.startswith("kvgen.v1"):  # generated stubs
            out[name] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """kvgen modules a file imports (at any depth: lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n.startswith("kvgen") and n != "kvgen":
                found.add(n)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(f"{m} -> {d}" for m, deps in graph().items() for d in deps if layer(d) > layer(m))
    assert not upward, "\n".join(upward)


def test_backends_know_nothing_of_the_engine_or_each_other():
    """kvgen/cpu and kvgen/gpu import only their own package (and kvgen.errors)."""
    for backend in ("kvgen.cpu", "kvgen.gpu"):
        outside = sorted(f"{m} -> {d}" for m, deps in graph().items() if m.startswith(backend + ".") or m == backend
                         for d in deps if not (d == backend or d.startswith(backend + ".") or d == "kvgen.errors"))
        assert not outside, "\n".join(outside)


def test_client_code_reaches_the_server_through_grpc_only():
    for m in ("kvgen.client", "kvgen.cli"):
        engine = sorted(d for d in graph().get(m, ()) if d.startswith(("kvgen.engine", "kvgen.service")))
        assert not engine, f"{m} imports {engine}"


def test_the_import_graph_has_no_cycle():
    g = graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_the_engine_reaches_gpu_through_one_module():
    """The model runner picks the attention backend (kernels or torch); the KV package may use the
    packing kernels for its warm tier, below the engine."""
    users = sorted(m for m, deps in graph().items() if m.startswith("kvgen.engine") and layer(m) != 2
                   and any(d.startswith("kvgen.gpu") for d in deps))
    assert users == ["kvgen.engine.model_runner"], users


def test_every_module_is_reached_from_the_server():
    """What `make serve` runs (kvgen.service.server) reaches every module through its imports,
    lazy ones included; the client side has its own entry points (client, cli)."""
    g = graph()
    seen, todo = set(), ["kvgen.service.server", "kvgen.client", "kvgen.cli"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(g.get(m, ()))
            todo.extend(p for p in g if m.startswith(p + "."))  # a module's package runs its __init__
    unreached = sorted(set(g) - seen)
    assert not unreached, unreached
