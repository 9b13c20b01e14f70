"""Constraints on a request's output: a JSON Schema, a regex, a Lark grammar, a list of choices,
or any JSON object, compiled by llguidance against the model's tokenizer.

llguidance turns a constraint into a matcher that, at each step, says which tokens may come
next (a bitmask over the vocabulary) and, once fed the sampled token, whether the output is
complete. Compiling costs from a millisecond to a second, so a compiled matcher is kept per
constraint text (LRU) and every request gets a cheap copy of it. Nothing here parses a schema
or a regex itself.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvgen.errors import InvalidRequest

KINDS = ("json_schema", "regex", "grammar", "choice", "json_object")
MAX_TEXT = 64 * 1024  # characters of one constraint (a schema, a grammar, the choices as JSON)
MAX_CHOICES = 1024

# Python's json.dumps separators and no free whitespace: a model writes the JSON it knows best,
# and it can neither pad its output with endless blanks nor run past max_new_tokens doing so.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str  # one of KINDS
    text: str = ""  # the schema / regex / grammar; for choice, the choices as a JSON list

    @classmethod
    def choice(cls, choices: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(choices)))

    @property
    def field(self) -> str:
        return f"sampling.{self.kind}"


class Grammars:
    """Compiles constraints for one tokenizer, and keeps the compiled ones (LRU).

    tokenizer: the model's `tokenizers.Tokenizer`; vocab_size: the model's (masks cover its
    logits); eos_ids: what ends an output once the grammar accepts."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], cache_size: int = 64):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.cache_size = cache_size
        # llguidance's tokenizer is built on first use (~0.3 s, from a 1.5 MB JSON of the vocab):
        # most servers never need it. Its own lock, so that the cache lock below, which the event
        # loop takes, is never held while it is built.
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()  # the event loop's threads and the engine may compile at once
        self.compiles = 0  # cold compilations (the cache missed)

    @property
    def tokenizer(self):
        import llguidance

        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._hf_tokenizer.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=self.eos_ids)
            return self._tokenizer

    def cached(self, c: Constraint) -> bool:
        with self._lock:
            return c in self._compiled

    def matcher(self, c: Constraint):
        """A fresh llguidance.LLMatcher for c (raises InvalidRequest naming c's field)."""
        with self._lock:
            pristine = self._compiled.get(c)
            if pristine is not None:
                self._compiled.move_to_end(c)
                return pristine.deep_copy()
        pristine = self._compile(c)
        with self._lock:
            self._compiled[c] = pristine
            self.compiles += 1
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return pristine.deep_copy()

    def _compile(self, c: Constraint):
        import llguidance

        try:
            grammar = grammar_of(c)
        except InvalidRequest:
            raise
        except ValueError as e:  # llguidance's own complaint about the document
            raise InvalidRequest([(c.field, f"cannot be enforced: {_message(str(e))}")]) from None
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequest([(c.field, f"cannot be enforced: {_message(m.get_error())}")])
        return m


def grammar_of(c: Constraint) -> str:
    """llguidance's grammar for c; InvalidRequest for a constraint that is malformed on its face
    (what the grammar engine rejects is found when it compiles)."""
    import llguidance

    if c.kind not in KINDS:
        raise InvalidRequest([("sampling.constraint", f"unknown constraint {c.kind!r}")])
    if len(c.text) > MAX_TEXT:
        raise InvalidRequest([(c.field, f"is {len(c.text)} characters; at most {MAX_TEXT}")])
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if c.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(check_schema(c.text), defaults=JSON_OPTIONS)
    if c.kind == "regex":
        if not c.text:
            raise InvalidRequest([(c.field, "must not be empty")])
        # \d is [0-9], as a caller checking with most regex engines' ASCII digits expects (Rust's
        # Unicode \d would let a model write digits from any script)
        return llguidance.LLMatcher.grammar_from_regex(llguidance.regex_to_lark(c.text, "d"))
    if c.kind == "grammar":
        if not c.text.strip():
            raise InvalidRequest([(c.field, "must not be empty")])
        return llguidance.LLMatcher.grammar_from_lark(c.text)
    choices = json.loads(c.text)
    if not choices:
        raise InvalidRequest([("sampling.choice.choices", "must not be empty")])
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest([("sampling.choice.choices", f"at most {MAX_CHOICES}; got {len(choices)}")])
    if any(not x for x in choices):
        raise InvalidRequest([("sampling.choice.choices", "must not contain empty strings")])
    # Lark string literals take JSON's escapes: any choice text becomes one terminal.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in choices))


def check_schema(text: str) -> dict:
    """A JSON Schema document: JSON, an object (or true), valid against its draft's metaschema."""
    import jsonschema

    field = "sampling.json_schema"
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise InvalidRequest([(field, f"is not JSON: {e}")]) from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequest([(field, "must be a JSON object (a schema)")])
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise InvalidRequest([(field, f"is not a valid JSON Schema: {_message(e.message)}")]) from None
    return schema


def _message(msg: str) -> str:
    """The engine's message on one line, clipped (a regex error spans several)."""
    return " ".join((msg or "").split())[:500] or "rejected by the grammar engine"


class Masks:
    """The token masks of a step's constrained rows, filled by llguidance's own thread pool (not
    torch's: a second OpenMP pool slows every step) from a helper thread, so they are computed
    while the forward pass runs; the matchers' states only depend on tokens already sampled."""

    def __init__(self, vocab_size: int, threads: int = 1):
        self.words = (vocab_size + 31) // 32
        self.threads = threads
        self._llg = None  # llguidance.LLExecutor, made on first use
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvgen-masks")

    def start(self, matchers: list) -> Future:
        """Begin filling one mask per matcher; the future gives the [len, words] int32 bitmask."""
        bitmask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        return self._helper.submit(self._fill, matchers, bitmask)

    def _fill(self, matchers: list, bitmask: torch.Tensor) -> torch.Tensor:
        if self._llg is None:
            import llguidance

            self._llg = llguidance.LLExecutor(num_threads=self.threads)
        self._llg.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                          self.words * 4, len(matchers))
        return bitmask

    def close(self) -> None:
        self._helper.shutdown(wait=False)
