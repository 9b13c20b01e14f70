"""LoRA adapters over one base model, chosen per request and batched together.

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors): for some of a layer's
q/k/v/o/gate/up/down projections, two matrices A [r, in] and B [out, r], and the output becomes
W x + scale * B A x, scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).

The engine keeps the base weights as they are (a GGUF's blocks stay quantized, nothing is merged):
a step's rows run the base linears once, all together, and then each adapter's rows get their
low-rank delta, y[rows] += (x[rows] A^T) B^T, one pair of small products per adapter and linear
(Punica's / S-LoRA's grouped products, in torch). The model fuses q|k|v and gate|up into one linear
each, so an adapter's A matrices of a fused linear are stacked along the rank (one product for all
of them) and its B matrices are laid out block-diagonally on the fused output rows, with q and k
rows in the model's interleaved RoPE order (model.interleave), the scale folded in.

Model.forward takes a `LoraBatch` (which rows use which adapter) and asks it for each layer's
linears (LoraBatch.layer); every other part of the model does not know adapters exist.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvgen.engine.model import Model, interleave
from kvgen.engine.model_config import UnsupportedModel

# PEFT's module names -> (the model's fused linear, the input it reads)
SPLIT_TARGETS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
                 "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
FUSED_TARGETS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}  # Phi-3
LINEARS = ("qkv", "o", "gate_up", "down")
_serials = itertools.count(1)
_KEY = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be loaded: the message names it and says what is wrong."""

    def __init__(self, name: str, path: str, what: str):
        super().__init__(f"LoRA adapter {name!r} ({path}): {what}")


class AdaptersUnsupported(UnsupportedModel):
    """A load on a base model whose family takes no adapters (a Mamba-2: model_mamba2.Mamba2.adapters_why_not).
    An UnsupportedModel, so LORA_ADAPTERS naming one stops the server at start in one line (server.serve);
    at run time FAILED_PRECONDITION / HTTP 400 (service/lora_admin.py), the server serving on."""


def check_takes_adapters(model, name: str, path: str) -> None:
    """AdaptersUnsupported, naming the model's family and why, where the model says it takes none (its
    adapters_why_not; Model's families all take them)."""
    why = getattr(model, "adapters_why_not", None)
    if why:
        raise AdaptersUnsupported(f"LoRA adapter {name[:128]!r} ({path}): the base model is a "
                                  f"{model.cfg.architecture} model, which takes no LoRA adapters: {why}")


@dataclass(frozen=True, slots=True)
class _Part:
    """Where one PEFT module's output sits in the model's fused linear."""

    linear: str
    offset: int
    rows: int
    in_features: int
    order: object  # fn(B rows) -> the model's row order (q / k interleave), or None


def model_parts(model: Model) -> dict[str, _Part]:
    """For each PEFT module name the model has, its place in the fused linears (Layer's layout)."""
    cfg = model.cfg
    nq, nkv, d, hidden, ffn = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q, kv = nq * d, nkv * d
    parts = {"o_proj": _Part("o", 0, hidden, q, None), "down_proj": _Part("down", 0, hidden, ffn, None)}
    if cfg.architecture == "phi3":  # one q|k|v matrix and one gate|up matrix in the file, as in the model

        def qkv_rows(t):
            tq, tk, tv = t.split([q, kv, kv])
            return torch.cat((interleave(tq, nq), interleave(tk, nkv), tv))

        parts["qkv_proj"] = _Part("qkv", 0, q + 2 * kv, hidden, qkv_rows)
        parts["gate_up_proj"] = _Part("gate_up", 0, 2 * ffn, hidden, None)
    else:
        parts["q_proj"] = _Part("qkv", 0, q, hidden, lambda t: interleave(t, nq))
        parts["k_proj"] = _Part("qkv", q, kv, hidden, lambda t: interleave(t, nkv))
        parts["v_proj"] = _Part("qkv", q + kv, kv, hidden, None)
        parts["gate_proj"] = _Part("gate_up", 0, ffn, hidden, None)
        parts["up_proj"] = _Part("gate_up", ffn, ffn, hidden, None)
    return parts


def _out_features(model: Model) -> dict[str, int]:
    layer = model.layers[0]
    return {name: getattr(layer, name).out_features for name in LINEARS}


@dataclass(slots=True, eq=False)  # by identity: a step groups its rows by adapter
class Adapter:
    """A loaded adapter: per layer, per fused linear, (A [R, in], B [out, R] with the scale folded in),
    R the sum of its modules' ranks there."""

    name: str
    path: str
    rank: int  # the highest rank of its modules
    targets: list[str]  # PEFT module names it adapts, sorted
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)
    requests: int = 0  # requests submitted with it (GetLoad, metrics)
    active: int = 0  # requests the engine holds with it now (an unload waits for none)
    serial: int = field(default_factory=lambda: next(_serials))  # this load (part of the prefix cache's key)
    # per layer, per fused linear, each module's block of B: (its first rank in A, its rank, its first
    # output row, its rows); B is zero outside them (the fused step reads the blocks only)
    spans: list[dict[str, list[tuple[int, int, int, int]]]] = field(default_factory=list, repr=False)
    fused: tuple | None = field(default=None, repr=False)  # fused_arrays' export, made on first use


def load_adapter(name: str, path: str, model: Model, max_rank: int) -> Adapter:
    """Read a PEFT LoRA folder or a llama.cpp GGUF LoRA file and check it against the model;
    AdapterError names what is wrong. Reads files only: callers run it off their event loop."""
    check_takes_adapters(model, name, path)
    where = Path(path)

    def bad(what: str) -> AdapterError:
        return AdapterError(name, path, what)

    if where.is_file():
        pairs = _read_gguf(where, model, bad)
    elif where.is_dir():
        pairs = _read_peft(where, model, bad)
    else:
        raise bad("not a folder nor a file (a PEFT adapter is a folder with adapter_config.json and "
                  "adapter_model.safetensors; llama.cpp's, a .gguf file from convert_lora_to_gguf.py)")
    if not pairs:
        raise bad("the file holds no LoRA weights")
    parts = model_parts(model)
    grouped: list[dict[str, list]] = [{} for _ in model.layers]
    top = 0
    for (layer, module), (a, b, scale_of) in sorted(pairs.items()):
        where_ = f"layer {layer} {module}"
        part = parts[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise bad(f"{where_}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not [r, in] and [out, r]")
        r = a.shape[0]
        if a.shape[1] != part.in_features or b.shape[0] != part.rows:
            raise bad(f"{where_}: lora_A {list(a.shape)}, lora_B {list(b.shape)} do not fit the base model's "
                      f"{module} ({part.rows} x {part.in_features}): an adapter of another model")
        if r > max_rank:
            raise bad(f"{where_} has rank {r}, over MAX_LORA_RANK={max_rank}")
        scale = scale_of(r)  # raises AdapterError where the file's own rank disagrees
        top = max(top, r)
        grouped[layer].setdefault(part.linear, []).append((part, a.float(), b.float() * scale))
    out = _out_features(model)
    act, device = model.act_dtype, model.device
    layers, spans = [], []
    for by_linear in grouped:
        fused, blocks = {}, {}
        for linear, items in by_linear.items():
            big_a = torch.cat([a for _, a, _ in items])  # [R, in]
            big_b = torch.zeros(out[linear], big_a.shape[0])
            at = 0
            for part, a, b in items:
                rows = b if part.order is None else part.order(b)
                big_b[part.offset:part.offset + part.rows, at:at + a.shape[0]] = rows
                blocks.setdefault(linear, []).append((at, a.shape[0], part.offset, part.rows))
                at += a.shape[0]
            fused[linear] = (big_a.to(device, act).contiguous(), big_b.to(device, act).contiguous())
        layers.append(fused)
        spans.append(blocks)
    return Adapter(name, path, top, sorted({module for _, module in pairs}), layers, spans=spans)


def fused_arrays(adapter: Adapter) -> tuple[np.ndarray, np.ndarray]:
    """The adapter as the fused decode step reads it (decode_step.py's LoRA spans): one flat float32
    array holding each module's A [r, in] and its block of B in runs of LANES output rows (B's
    zeros outside the blocks are not kept: the step reads a third of q|k|v's B, half of gate|up's),
    and the table [layers, 4 linears, spans, SPAN_FIELDS] of where each lies (rank 0 ends a linear's
    spans). Made once per adapter, on first use (a model that never runs the step never holds it)."""
    from kvgen.cpu import decode_step
    from kvgen.cpu.lora_lanes import LANES

    if adapter.fused is not None:
        return adapter.fused
    most = max((len(s) for layer in adapter.spans for s in layer.values()), default=1)
    table = np.zeros((len(adapter.layers), len(LINEARS), most, decode_step.SPAN_FIELDS), np.int64)
    chunks, at = [], 0
    for i, (pairs, blocks) in enumerate(zip(adapter.layers, adapter.spans, strict=True)):
        for j, linear in enumerate(LINEARS):
            if linear not in pairs:
                continue
            a, b = (t.float().cpu().numpy() for t in pairs[linear])
            for s, (first, r, row, rows) in enumerate(blocks[linear]):
                table[i, j, s] = (at, at + r * a.shape[1], r, row, rows)
                # B's block [rows, r] as [rows / LANES, r, LANES]: the step adds LANES output columns at a
                # time, summing over the ranks, so it reads the block in order, once (one stream, not r)
                block = b[row:row + rows, first:first + r].reshape(rows // LANES, LANES, r).transpose(0, 2, 1)
                chunks += [a[first:first + r].ravel(), np.ascontiguousarray(block).ravel()]
                at += r * (a.shape[1] + rows)
    data = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    adapter.fused = (data.astype(np.float32, copy=False), table)
    return adapter.fused


def _read_peft(folder: Path, model: Model, bad) -> dict:
    """A PEFT folder's {(layer, module): (A [r, in], B [out, r] in HF's row order, fn(r) -> scale)}."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise bad("no adapter_config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"adapter_config.json is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise bad("adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {config.get('peft_type')!r}; only LORA adapters run")
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (GPT-2's Conv1D layout)")):
        if config.get(key):
            raise bad(f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise bad(f"bias={config['bias']!r}: adapters that train biases are not supported")
    if config.get("modules_to_save"):
        raise bad(f"modules_to_save {config['modules_to_save']}: adapters that replace whole modules are not "
                  "supported")
    parts = model_parts(model)
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regex: the tensors below say what it matched
        lacking = sorted(set(targets) - set(parts))
        if lacking:
            raise bad(f"target modules {lacking}, which this {model.cfg.architecture} model lacks "
                      f"(it has {sorted(parts)})")
    st = folder / "adapter_model.safetensors"
    if not st.exists():
        raise bad("no adapter_model.safetensors" + (" (adapter_model.bin, pickled weights, is not read)"
                                                    if (folder / "adapter_model.bin").exists() else ""))
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(st))
    except Exception as e:  # safetensors raises its own error types for a torn or foreign file
        raise bad(f"adapter_model.safetensors does not read: {e}") from None
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise bad(f"tensor {key!r} is not a layer's lora_A / lora_B weight (embedding or lm_head adapters, "
                      "DoRA magnitudes and trained biases are not supported)")
        layer, module, ab = int(m[1]), m[2], m[3]
        _check_place(bad, key, layer, module, model, parts)
        found.setdefault((layer, module), {})[ab] = t
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    default_alpha = config.get("lora_alpha", 8)
    rslora = bool(config.get("use_rslora"))

    def scale_of(layer: int, module: str):
        def scale(r: int) -> float:
            expected = _pattern(rank_pattern, layer, module, config.get("r", r))
            if expected != r:
                raise bad(f"layer {layer} {module}: rank {r} in the tensors, {expected} in adapter_config.json")
            alpha = _pattern(alpha_pattern, layer, module, default_alpha)
            return alpha / math.sqrt(r) if rslora else alpha / r

        return scale

    return {(layer, module): (ab["A"], ab["B"], scale_of(layer, module))
            for (layer, module), ab in _complete(bad, found).items()}


# llama.cpp's tensor names (blk.N.<name>.weight.lora_a / .lora_b) -> PEFT's module names
_GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_GGUF_PHI3 = {"attn_qkv": "qkv_proj", "attn_output": "o_proj", "ffn_up": "gate_up_proj", "ffn_down": "down_proj"}
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
_GGUF_FLOATS = ("F32", "F16", "BF16", "Q8_0")
# the architectures whose converter writes one name for another family (llama.cpp's own mapping)
_GGUF_ARCH = {"mistral": "llama"}


def _read_gguf(file: Path, model: Model, bad) -> dict:
    """A llama.cpp GGUF LoRA (convert_lora_to_gguf.py): {(layer, module): (A, B in HF's row order, fn(r) ->
    scale)}. The scale is llama.cpp's, adapter.lora.alpha / r (1 without an alpha); the converter keeps
    neither rsLoRA nor rank / alpha patterns, so neither does the file."""
    import gguf

    from kvgen.engine.model_files import _PERMUTED_ARCHS, _unpermute

    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:  # gguf-py raises ValueError / struct / numpy errors on a file of another kind
        raise bad(f"not a GGUF file ({type(e).__name__}: {e})") from None

    def text(key: str) -> str | None:
        f = reader.fields.get(key)
        return None if f is None else str(f.contents())

    if text("general.type") != "adapter" or text("adapter.type") != "lora":
        raise bad(f"a GGUF of general.type {text('general.type')!r}, adapter.type {text('adapter.type')!r}: not "
                  "a LoRA adapter (llama.cpp's convert_lora_to_gguf.py writes 'adapter', 'lora')")
    arch, ours = text("general.architecture"), model.cfg.architecture
    if _GGUF_ARCH.get(arch, arch) != _GGUF_ARCH.get(ours, ours):
        raise bad(f"an adapter of a {arch!r} model; the base model is {ours!r}")
    alpha_field = reader.fields.get("adapter.lora.alpha")
    alpha = float(alpha_field.contents()) if alpha_field is not None else 0.0
    names = _GGUF_PHI3 if ours == "phi3" else _GGUF_MODULES
    parts = model_parts(model)
    cfg = model.cfg
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        m = _GGUF_KEY.match(t.name)
        if m is None or m[2] not in names:
            raise bad(f"tensor {t.name!r} is not a layer's q/k/v/o/gate/up/down lora_a / lora_b (token embedding, "
                      "output and norm adapters are not supported)")
        if t.tensor_type.name not in _GGUF_FLOATS:
            raise bad(f"tensor {t.name!r} is {t.tensor_type.name}; adapters are read as {', '.join(_GGUF_FLOATS)}")
        layer, module = int(m[1]), names[m[2]]
        _check_place(bad, t.name, layer, module, model, parts)
        data = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy: not the map
        w = torch.from_numpy(data.reshape(tuple(int(x) for x in reversed(t.shape.tolist()))))
        if m[3] == "b" and ours in _PERMUTED_ARCHS and module in ("q_proj", "k_proj"):
            # the converter permuted B's q/k rows as it does the model's (llama.cpp's RoPE layout): undo it
            heads = cfg.num_heads if module == "q_proj" else cfg.num_kv_heads
            if w.shape[0] % (2 * heads) == 0:  # else the shape check names the misfit
                w = _unpermute(w, heads)
        found.setdefault((layer, module), {})[m[3].upper()] = w

    def scale(r: int) -> float:
        return alpha / r if alpha else 1.0  # llama_adapter_lora_weight::get_scale

    return {key: (ab["A"], ab["B"], scale) for key, ab in _complete(bad, found).items()}


def _check_place(bad, key: str, layer: int, module: str, model: Model, parts: dict) -> None:
    if module not in parts:
        raise bad(f"tensor {key!r} adapts {module}, which this {model.cfg.architecture} model lacks")
    if layer >= len(model.layers):
        raise bad(f"tensor {key!r} is for layer {layer}; the model has {len(model.layers)} layers")


def _complete(bad, found: dict) -> dict:
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise bad(f"layer {layer} {module} has lora_{''.join(ab)} without its lora_{'B' if 'A' in ab else 'A'}")
    return found


def _pattern(patterns: dict, layer: int, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the end of the
    module's name (PEFT's own rule: re.match of (.*\\.)?key$), else the default."""
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") else "self_attn"
    name = f"model.layers.{layer}.{block}.{module}"
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


class AdapterInUse(RuntimeError):
    """An unload that timed out waiting for the requests running with the adapter (FAILED_PRECONDITION):
    the adapter stays loaded."""


class TooManyAdapters(RuntimeError):
    """A load beyond MAX_LORAS (RESOURCE_EXHAUSTED)."""


class AdapterExists(ValueError):
    """A load under a name that is loaded, or being loaded or unloaded (ALREADY_EXISTS)."""


class AdapterStore:
    """The adapters the server holds, by name: loaded at start (LORA_ADAPTERS) and at run time.

    Any thread may look a name up (the event loops' request handlers, the metrics scrape); the engine
    thread never reads the store, only each sequence's Adapter. Changes take the lock and publish a
    new dict (copy on write), so a reader iterating `adapters` never sees it change under it. A name
    being loaded or unloaded is reserved (`busy`): a second load or unload of it is refused."""

    def __init__(self, model: Model, max_loras: int = 8, max_rank: int = 64):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.adapters: dict[str, Adapter] = {}
        self._lock = threading.Lock()
        self._busy: set[str] = set()  # names being loaded or unloaded

    @classmethod
    def from_setting(cls, spec: str, model: Model, max_loras: int = 8, max_rank: int = 64) -> AdapterStore:
        """LORA_ADAPTERS: name=path,name=path,... (a PEFT folder or a llama.cpp .gguf file)"""
        store = cls(model, max_loras, max_rank)
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, eq, path = item.partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ValueError(f"LORA_ADAPTERS entry {item!r}: expected name=folder or name=file.gguf")
            try:
                store.load(name.strip(), path.strip())
            except AdaptersUnsupported as e:  # the setting named, for the start's one line
                raise AdaptersUnsupported(f"LORA_ADAPTERS: {e}") from None
        return store

    def load(self, name: str, path: str) -> Adapter:
        """Read and publish an adapter (blocking: the files are read here). AdapterExists, TooManyAdapters,
        AdapterError."""
        self.reserve(name, path)
        try:
            adapter = load_adapter(name, path, self.model, self.max_rank)
        except BaseException:
            self.unreserve(name)
            raise
        self.publish(adapter)
        return adapter

    def reserve(self, name: str, path: str = "") -> None:
        """The first half of a load: hold the name and a MAX_LORAS slot while the files are read (nothing held
        where the model takes no adapters: AdaptersUnsupported)."""
        check_takes_adapters(self.model, name, path)
        with self._lock:
            if name in self.adapters or name in self._busy:
                raise AdapterExists(f"LoRA adapter {name[:128]!r}: an adapter of this name is loaded already"
                                    if name in self.adapters else
                                    f"LoRA adapter {name[:128]!r} is being loaded or unloaded")
            taken = len(self.adapters) + len(self._busy)
            if taken >= self.max_loras:
                raise TooManyAdapters(f"LoRA adapter {name[:128]!r} ({path}): {taken} adapters are loaded already "
                                      f"(MAX_LORAS={self.max_loras})")
            self._busy.add(name)

    def publish(self, adapter: Adapter) -> None:
        with self._lock:
            self._busy.discard(adapter.name)
            self.adapters = {**self.adapters, adapter.name: adapter}

    def unreserve(self, name: str) -> None:
        with self._lock:
            self._busy.discard(name)

    def withdraw(self, name: str) -> Adapter | None:
        """The first half of an unload: from now on the name is not found (new requests are refused)
        while its running requests finish; None if it is not loaded."""
        with self._lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                return None
            self.adapters = {k: v for k, v in self.adapters.items() if k != name}
            self._busy.add(name)  # its slot stays taken until the unload ends
            return adapter

    def restore(self, adapter: Adapter) -> None:
        """An unload that gave up: the adapter serves again, as loaded."""
        self.publish(adapter)

    def forget(self, adapter: Adapter) -> None:
        """An unload that finished: the name and the slot are free."""
        self.unreserve(adapter.name)

    def acquire(self, adapter: Adapter) -> bool:
        """Count a request starting with `adapter` if it is still the one loaded under its name (False
        once an unload has withdrawn it); release() when the engine lets the request go."""
        with self._lock:
            if self.adapters.get(adapter.name) is not adapter:
                return False
            adapter.active += 1
            adapter.requests += 1
            return True

    def release(self, adapter: Adapter) -> None:
        with self._lock:
            adapter.active -= 1

    def get(self, name: str) -> Adapter | None:
        return self.adapters.get(name)

    def names(self) -> list[str]:
        return list(self.adapters)


class LoraBatch:
    """Which of a step's token rows run with which adapter: groups of (adapter, row ranges)."""

    def __init__(self, groups: dict[Adapter, list[tuple[int, int]]], device: torch.device):
        self.groups = []
        for adapter, ranges in groups.items():
            if len(ranges) == 1:
                rows = slice(*ranges[0])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)
            self.groups.append((adapter, rows))

    @classmethod
    def of(cls, adapters: list[tuple[Adapter | None, int]], device: torch.device) -> LoraBatch | None:
        """From each sequence's adapter and its number of rows, in the step's row order; None when
        no row has an adapter (the step runs as it would without adapters)."""
        groups: dict[Adapter, list[tuple[int, int]]] = {}
        at = 0
        for adapter, n in adapters:
            if adapter is not None:
                ranges = groups.setdefault(adapter, [])
                if ranges and ranges[-1][1] == at:  # neighbours with the same adapter: one range
                    ranges[-1] = (ranges[-1][0], at + n)
                else:
                    ranges.append((at, at + n))
            at += n
        return cls(groups, device) if groups else None

    def layer(self, i: int, layer) -> _AdaptedLayer:
        return _AdaptedLayer(self, i, layer)

    def add(self, i: int, linear: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base linear's output for x) plus each group's delta on its rows, in place."""
        for adapter, rows in self.groups:
            ab = adapter.layers[i].get(linear)
            if ab is None:
                continue
            a, b = ab
            delta = torch.mm(torch.mm(x[rows], a.t()), b.t())
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y


class _AdaptedLayer:
    """A layer's four linears as Model.forward calls them, each with the step's deltas added."""

    def __init__(self, batch: LoraBatch, i: int, layer):
        self._batch, self._i, self._layer = batch, i, layer

    def qkv(self, x):
        return self._batch.add(self._i, "qkv", x, self._layer.qkv(x))

    def o(self, x):
        return self._batch.add(self._i, "o", x, self._layer.o(x))

    def gate_up(self, x):
        return self._batch.add(self._i, "gate_up", x, self._layer.gate_up(x))

    def down(self, x):
        return self._batch.add(self._i, "down", x, self._layer.down(x))
