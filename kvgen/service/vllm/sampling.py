"""vLLM's GenerateRequest (vllm_engine.proto) -> kvgen.v1's, which the kvgen.v1 servicer then
runs as any other: the same checks and limits, Abort, traces. proto3 leaves most of vLLM's
sampling fields without presence, so 0 means "not given", as vLLM's own servicer reads them.
What kvgen cannot do is refused by name (INVALID_ARGUMENT), never quietly ignored."""

from __future__ import annotations

from kvgen.errors import InvalidRequest
from kvgen.v1 import generate_pb2 as pb

MAX_TOP = 20  # logprobs alternatives: the engine's own limit (sampling.validate)
INT32_MAX = 2**31 - 1
# GenerateRequest fields for disaggregated prefill / decode, data parallelism and images
UNSUPPORTED = {
    "kv_transfer_params": "KV transfer between workers is not supported",
    "kv_transfer_params_json": "KV transfer between workers is not supported",
    "mm_inputs": "the model takes text only",
    "media_refs": "the model takes text only",
}


def to_kvgen(req, eos_ids: list[int]) -> pb.GenerateRequest:
    """eos_ids: the model's; vLLM's stop_token_ids stop the output beside them (kvgen.v1's
    replace them)."""
    bad = [(name, why) for name, why in UNSUPPORTED.items() if req.HasField(name)]
    if len(req.extra_mm_inputs):
        bad.append(("extra_mm_inputs", "the model takes text only"))
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        bad.append(("data_parallel_rank", f"this worker has one rank (0); got {req.data_parallel_rank}"))
    out = pb.GenerateRequest(request_id=req.request_id)
    kind = req.WhichOneof("input")
    if kind == "text":
        out.prompt = req.text
    elif kind == "tokenized":
        ids = list(req.tokenized.input_ids)
        if any(t > INT32_MAX for t in ids):
            bad.append(("tokenized.input_ids", "token ids must be below 2^31"))
        else:
            out.prompt_token_ids.extend(ids)
    bad += _sampling(req.sampling_params, out.sampling, eos_ids)
    if bad:
        raise InvalidRequest(bad)
    return out


def _sampling(s, p: pb.SamplingParams, eos_ids: list[int]) -> list[tuple[str, str]]:
    bad = []
    p.temperature = s.temperature if s.HasField("temperature") else 1.0  # vLLM's default
    p.top_p = s.top_p or 1.0
    p.top_k = min(s.top_k, INT32_MAX)
    p.min_p = s.min_p
    p.frequency_penalty = s.frequency_penalty
    p.presence_penalty = s.presence_penalty
    p.repetition_penalty = s.repetition_penalty or 1.0
    if s.HasField("max_tokens"):
        p.max_new_tokens = min(s.max_tokens, INT32_MAX)
    p.min_new_tokens = min(s.min_tokens, INT32_MAX)
    p.stop_strings.extend(s.stop)
    p.ignore_eos = s.ignore_eos
    if s.stop_token_ids:
        if any(t > INT32_MAX for t in s.stop_token_ids):
            bad.append(("sampling_params.stop_token_ids", "token ids must be below 2^31"))
        else:
            p.stop_token_ids.extend(dict.fromkeys([*eos_ids, *s.stop_token_ids]))
    p.n = min(s.n or 1, INT32_MAX)
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name):
            k = getattr(s, name)
            if not 0 <= k <= MAX_TOP:  # -1 (the whole vocabulary) included
                bad.append((f"sampling_params.{name}", f"must be in [0, {MAX_TOP}]; got {k}"))
            else:
                setattr(p, name, k)
    if s.HasField("seed"):
        p.seed = s.seed % 2**64
    for t, b in s.logit_bias.items():
        p.logit_bias[t] = b
    if s.HasField("truncate_prompt_tokens"):
        bad.append(("sampling_params.truncate_prompt_tokens", "not supported: send the prompt to be used"))
    kind = s.WhichOneof("constraint")
    if kind == "choice":
        p.choice.choices.extend(s.choice.choices)
    elif kind == "structural_tag":
        bad.append(("sampling_params.structural_tag",
                    "not supported (json_schema, regex, grammar, choice and json_object are)"))
    elif kind is not None:  # json_schema, regex, grammar (Lark, as kvgen.v1's), json_object
        setattr(p, kind, getattr(s, kind))
    return bad
