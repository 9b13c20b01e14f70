"""EAGLE drafting (Li et al. 2024): a light head drafts from the target's own features instead of
a second model. The head is one decoder layer whose input at position j is
fc([embed(token j+1); feature j]) (the target's final-norm hidden state at j), and whose output
is its guess of the target's feature at j+1; the target's LM head turns that into logits. So it
drafts token after token from its own guessed features, and checks cost the target nothing extra.

Layout read (EAGLE-1's safetensors, as published with its heads): `fc.weight` [H, 2H] (and
`fc.bias`), `layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight` (its layer has no input norm); `embed_tokens` and the
LM head are the target's. Shapes must match the target's config.

The head keeps its own one-layer paged KV (a pool of its own). Only positions whose feature came
from the target are kept there: a proposal feeds the target features it has not seen yet in one
chunk, then drafts k tokens on guessed features, and drops those positions again. A prompt whose
start came from the prefix cache has no features for that start: the head's cache then begins
at the first position the target computed (its keys keep their true RoPE positions), so the
head attends to less context there and guesses worse, but drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvgen.cpu.weight_blocks import GROUP, BlockLinear, WeightBlocks
from kvgen.engine.attention import TORCH_ATTENTION, Step
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model import Layer, Linear, Model, apply_rope
from kvgen.engine.speculative.draft_model import PLAIN, pick
from kvgen.errors import PoolExhausted

PREFIX = "layers.0."


def load_head(path: str) -> dict[str, torch.Tensor]:
    """An EAGLE head's tensors from a .safetensors file or a folder holding model.safetensors."""
    p = Path(path)
    if p.is_dir():
        p = p / "model.safetensors"
    if not p.exists():
        raise FileNotFoundError(f"EAGLE_HEAD: no {p}")
    return load_file(str(p))


class EagleHead:
    """The head's one layer, over the target's embeddings, RoPE and LM head."""

    def __init__(self, target: Model, weights: dict[str, torch.Tensor]):
        cfg = target.cfg
        hidden = cfg.hidden_size
        if target.act_dtype != torch.float32:  # the head computes in fp32 over the target's activations
            raise ValueError(f"SPECULATIVE=eagle needs a target that computes in fp32 (WEIGHT_DTYPE fp32 or gguf); "
                             f"this one computes in {target.act_dtype}")
        fc = weights.get("fc.weight")
        if fc is None or tuple(fc.shape) != (hidden, 2 * hidden):
            raise ValueError(f"EAGLE head: fc.weight must be [{hidden}, {2 * hidden}] for this model; got "
                             f"{None if fc is None else tuple(fc.shape)}")
        w = {f"model.{k}": v.float() for k, v in weights.items() if k.startswith(PREFIX)}
        w["model.layers.0.input_layernorm.weight"] = torch.ones(hidden)  # unused: the layer has no input norm
        # Over block (gguf) weights the head's matrices go to Q8_0 blocks too: a drafted token
        # reads them all, and as fp32 (17 MB for SmolLM2's) that read cost 1.6 ms a token, about a
        # third of the target's own decode step; drafts need not be exact, only cheap.
        blocks = None
        if target.weight_dtype == "gguf":
            blocks = {k: WeightBlocks.q8_from_float(v) for k, v in w.items() if v.ndim == 2 and v.shape[1] % GROUP == 0}
        try:
            self.layer = Layer(cfg, w, 0, "gguf" if blocks else "fp32", target.act_dtype, blocks)
        except KeyError as e:
            raise ValueError(f"EAGLE head: missing tensor {str(e)[len('model.') + 1:-1]}") from None
        bias = weights.get("fc.bias")
        bias = None if bias is None else bias.float()
        self.fc = BlockLinear(WeightBlocks.q8_from_float(fc), bias) if blocks else Linear(fc.float(), bias, "fp32")
        self.target, self.cfg = target, cfg
        if target.device.type != "cpu":
            move = lambda t: t.to(target.device)  # noqa: E731
            self.layer.to(move)
            self.fc.to(move)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, step: Step, fmt, store) -> torch.Tensor:
        """Guessed next features [T, H] for tokens ids [T] at step.positions given the target's
        (or guessed) features of the positions before them."""
        cfg, t = self.cfg, self.target
        x = self.fc(torch.cat([t.embed[ids], feats.to(t.act_dtype)], dim=-1))
        T, nq, nkv = x.shape[0], cfg.num_heads, cfg.num_kv_heads
        qkv = self.layer.qkv(x).view(T, -1, cfg.head_dim)
        qk = apply_rope(qkv[:, :nq + nkv], t.rot[step.positions].unsqueeze(1))
        a = TORCH_ATTENTION.write_and_attend(fmt, store, 0, qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:], step)
        h = x + self.layer.o(a.reshape(T, nq * cfg.head_dim))
        gu = self.layer.gate_up(self.layer.ln2(h))
        half = cfg.intermediate_size
        return h + self.layer.down(F.silu(gu[:, :half]) * gu[:, half:])


class Eagle:
    """The drafter: per sequence, the head's cache and the target features it has not read yet."""

    wants_features = True
    first_k = 1  # as DraftModel's: a drafted token costs a forward of the head and the LM head

    def __init__(self, target: Model, weights: dict[str, torch.Tensor], kv_mb: float = 32.0, block_size: int = 16):
        self.head = EagleHead(target, weights)
        cfg = target.cfg
        self.fmt = make_format(PLAIN[target.act_dtype], 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                               compute_dtype=target.act_dtype)
        self.pool = BlockPool.from_budget(self.fmt, kv_mb, target.device)
        self._state: dict[object, _Head] = {}

    def observe(self, seq, start: int, features: torch.Tensor) -> None:
        """The target's features of seq's positions start.. (those whose K/V it kept this step)."""
        state = self._state.get(seq)
        if state is None or start < state.first:  # new, or preempted back past where its cache began
            if state is not None:
                state.cache.reset()
            state = self._state[seq] = _Head(PagedKVCache(self.pool), {}, start)
        for i in range(features.shape[0]):
            state.feats[start + i] = features[i]
        if state.end > start:  # a rejected draft (or a preemption) rewrote these positions
            state.cache.truncate(start - state.first)

    def propose(self, wanted: list[tuple[object, int]]) -> dict[object, tuple[list[int], torch.Tensor | None]]:
        out = {}
        for seq, k in wanted:
            drafted = self._draft(seq, k)
            if drafted is not None:
                out[seq] = drafted
        return out

    def _draft(self, seq, k: int):
        state = self._state.get(seq)
        if state is None:
            return None
        cache, feats = state.cache, state.feats
        tokens = seq.tokens
        last = len(tokens) - 1  # the newest token: the target has not computed its feature yet
        need = range(state.end, last)
        if not need or any(j not in feats for j in need):
            return None
        try:
            cache.reserve(len(need) + k - 1)
        except PoolExhausted:
            self.forget(seq)
            return None
        dev = self.head.target.device
        ids = torch.tensor(tokens[state.end + 1:last + 1], device=dev)
        f = torch.stack([feats.pop(j) for j in need])
        drafted, qs = [], []
        pos = state.end
        while True:
            n = ids.shape[0]
            guess = self._run(state, pos, ids, f)
            logits = self.head.target.lm_head(guess[-1:]).float().cpu()
            token, q = pick(logits, seq, tokens + drafted)
            drafted.append(token)
            qs.append(q)
            pos += n
            if len(drafted) == k:
                break
            ids, f = torch.tensor([token], device=dev), guess[-1:]
        cache.truncate(last - state.first)  # guessed features' positions go: the target's own come next time
        return drafted, None if qs[0] is None else torch.stack(qs)

    def _run(self, state: _Head, start: int, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """The head over positions start.. (its cache holds state.first .. start - 1)."""
        n = ids.shape[0]
        dev = ids.device
        blocks, offsets = state.cache.slots(start - state.first, n)
        step = Step(positions=torch.arange(start, start + n, device=dev), write_blocks=blocks.to(dev),
                    write_offsets=offsets.to(dev), query_lens=[n], context_lens=[start + n],
                    block_tables=torch.tensor([state.cache.blocks], device=dev), logits_rows=None,
                    is_decode=n == 1, kv_starts=[state.first] if state.first else None)
        out = self.head.forward(ids, feats, step, self.fmt, self.pool.store)
        state.cache.advance(n)
        return out

    def lag(self, seq) -> int:
        """None that counts: the head keeps every position's feature as the target computes it,
        and catching up is its one layer over them (a thirtieth of a draft model's prefill)."""
        return 0

    def forget(self, seq) -> None:
        state = self._state.pop(seq, None)
        if state is not None:
            state.cache.reset()

    @property
    def sequences(self) -> int:
        return len(self._state)


@dataclass
class _Head:
    """One sequence's drafting state: the head's cache, which holds positions first .. end - 1,
    and the target's features it has not read yet (position -> [hidden])."""

    cache: PagedKVCache
    feats: dict[int, torch.Tensor]
    first: int

    @property
    def end(self) -> int:
        return self.first + self.cache.length
