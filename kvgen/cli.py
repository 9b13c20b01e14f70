"""`kvgen`: stream text from a kvgen server.

    kvgen "Once upon a time" --max-new-tokens 64
    kvgen --chat "What is the capital of France?" --temperature 0
    kvgen --info
    kvgen --info --target host:443 --ca-file ca.pem --cert-file me.pem --key-file me.key
    KVGEN_TARGET=host:50051 KVGEN_API_KEY=... kvgen "Hi" --json | jq -r .text
    kvgen --batch "Once upon a time" --batch "The capital of France is" --max-new-tokens 32

--target defaults to $KVGEN_TARGET (else localhost:$PORT, else localhost:50051), --api-key to
$KVGEN_API_KEY (else $API_KEY). --json prints one JSON object per line: each stream message (the
proto's JSON, as grpcurl prints it: the last carries finishReason, usage and timings), the model
info with --info, or {"error": {"code", "message", "fieldViolations"?, "retryDelay"?}} when the
call fails (exit status 1). UNAVAILABLE before the first token is retried (--retries tries in
all); --timeout bounds the whole call.

--batch runs its prompts (and the positional one, first, if given) together in one
BatchGenerateStream, with the same options: each entry's text is printed as `[i] text` once it
is complete (its usage on stderr), a failed entry's error on stderr (exit status 1), the others
going on; with --json every message of the stream as it comes (`index` names the entry).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvgen.client import Client, KvgenError, Retry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvgen", description="Stream text from a kvgen server.")
    ap.add_argument("prompt", nargs="?", help="raw prompt text (or a chat message with --chat)")
    ap.add_argument("--target", default=os.environ.get("KVGEN_TARGET", f"localhost:{os.environ.get('PORT', 50051)}"))
    ap.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    ap.add_argument("--system", help="system message (with --chat)")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--repetition-penalty", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--min-p", type=float)
    ap.add_argument("--presence-penalty", type=float)
    ap.add_argument("--frequency-penalty", type=float)
    ap.add_argument("--min-new-tokens", type=int, help="no stop token before this many tokens")
    ap.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                    help="speculative decoding on / off for this request (default: the server's SPECULATIVE)")
    ap.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                    help="add BIAS to token ID's logit (repeatable)")
    ap.add_argument("--prompt-logprobs", type=int, metavar="K",
                    help="print each prompt token's logprob (with K alternatives) to stderr")
    one = ap.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="SCHEMA", help="the output is JSON valid against SCHEMA (text or @file)")
    one.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    one.add_argument("--regex", help="the output matches this regular expression")
    one.add_argument("--grammar", metavar="LARK", help="the output parses with this Lark grammar (text or @file)")
    one.add_argument("--choice", action="append", help="the output is one of the --choice values (repeatable)")
    ap.add_argument("--batch", action="append", default=[], metavar="PROMPT",
                    help="a prompt run together with the others in one batch stream (repeatable)")
    ap.add_argument("--info", action="store_true", help="print the served model's info and exit")
    ap.add_argument("--api-key", default=os.environ.get("KVGEN_API_KEY") or os.environ.get("API_KEY", ""),
                    help="the server's API key (default: $KVGEN_API_KEY, else $API_KEY)")
    ap.add_argument("--json", action="store_true",
                    help="print each stream message (or --info) as one JSON object per line, for scripts")
    ap.add_argument("--tls", action="store_true", help="connect with TLS, verifying the server by the system's roots")
    ap.add_argument("--ca-file", help="PEM CA that signed the server's certificate (implies --tls)")
    ap.add_argument("--cert-file", help="PEM client certificate, for a server that requires one (with --key-file)")
    ap.add_argument("--key-file", help="PEM private key of --cert-file")
    ap.add_argument("--timeout", type=float, help="deadline of the call in seconds (default: none)")
    ap.add_argument("--retries", type=int, default=4, metavar="N",
                    help="tries in all when the server is unavailable before the first token (default 4)")
    args = ap.parse_args(argv)
    if bool(args.cert_file) != bool(args.key_file):
        ap.error("--cert-file and --key-file go together")
    if args.retries < 1:
        ap.error("--retries is at least 1")
    client = Client(args.target, args.api_key, tls=args.tls, ca_file=args.ca_file, cert_file=args.cert_file,
                    key_file=args.key_file, timeout=args.timeout, retry=Retry(attempts=args.retries))
    try:
        if args.info:
            info = client.model_info()
            print(_json(info.raw) if args.json else info.raw)
            return 0
        if args.prompt is None and not args.batch:
            ap.error("a prompt is required")

        def prompt_of(text: str):
            if not args.chat:
                return text
            return ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": text}]
        sampling = {k: v for k, v in {
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "repetition_penalty": args.repetition_penalty, "seed": args.seed,
            "min_p": args.min_p, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty, "min_new_tokens": args.min_new_tokens,
            "speculative": args.speculative,
            "prompt_logprobs": args.prompt_logprobs, **_constraint(args), **_logit_bias(ap, args.logit_bias),
        }.items() if v is not None}
        if args.batch:
            texts = ([args.prompt] if args.prompt is not None else []) + args.batch
            return _batch_stream(client, [prompt_of(t) for t in texts], args.json, stop_strings=args.stop,
                                 **sampling)
        first = last = None
        for msg in client.stream(prompt_of(args.prompt), stop_strings=args.stop, **sampling):
            first = first or msg
            if args.json:  # every message whole, the last one with finish_reason, usage and timings
                print(_json(msg.raw), flush=True)
                continue
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            last = msg
        if args.json:
            return 0
        sys.stdout.write("\n")
        if first is not None and first.prompt_logprobs:
            for p in first.prompt_logprobs:
                alts = ", ".join(f"{t.token!r} {t.logprob:.3f}" for t in p.top)
                print(f"prompt {p.token!r} {p.logprob:.3f}" + (f" [{alts}]" if alts else ""), file=sys.stderr)
        if last is not None and last.usage is not None:
            u = last.usage
            print(f"[FINISH_REASON_{last.finish_reason.name}; prompt {u.prompt_tokens}, "
                  f"completion {u.completion_tokens}, cached {u.cached_tokens} tokens; "
                  f"ttft {last.timings.time_to_first_token_ms:.0f} ms, total {last.timings.total_ms:.0f} ms]",
                  file=sys.stderr)
        return 0
    except KvgenError as e:
        if args.json:
            print(json.dumps({"error": _error(e)}, separators=(",", ":")), flush=True)
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        for v in e.field_violations:
            print(f"  {v.field}: {v.description}", file=sys.stderr)
        if e.retry_delay is not None:
            print(f"  retry after {e.retry_delay:g} s", file=sys.stderr)
        return 1
    finally:
        client.close()


def _batch_stream(client: Client, prompts: list, as_json: bool, **kw) -> int:
    """Run prompts as one BatchGenerateStream: print each message (--json), or each entry's text
    once it is complete. 1 if any entry failed."""
    texts: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
    failed = False
    for item in client.batch_stream(prompts, **kw):
        if as_json:
            print(_json(item.raw), flush=True)
        if item.error is not None:
            failed = True
            e = item.error
            print(f"[{item.index}] error: {e.code().name}: {e.details()}", file=sys.stderr)
            for v in e.field_violations:
                print(f"[{item.index}]   {v.field}: {v.description}", file=sys.stderr)
            continue
        d = item.delta
        texts[item.index].append(d.text)
        if d.finish_reason and d.raw.index == 0 and not as_json:  # the entry (its first sample) is complete
            print(f"[{item.index}] {''.join(texts[item.index])}", flush=True)
            u = d.usage
            print(f"[{item.index}] [FINISH_REASON_{d.finish_reason.name}; prompt {u.prompt_tokens}, "
                  f"completion {u.completion_tokens}, cached {u.cached_tokens} tokens]", file=sys.stderr)
    return 1 if failed else 0


def _text_or_file(value: str) -> str:
    """"@path" reads a file: a schema or a grammar is rarely one shell word."""
    return open(value[1:], encoding="utf-8").read() if value.startswith("@") else value


def _constraint(args) -> dict:
    from kvgen.v1 import generate_pb2 as pb

    if args.json_schema is not None:
        return {"json_schema": _text_or_file(args.json_schema)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar is not None:
        return {"grammar": _text_or_file(args.grammar)}
    if args.choice:
        return {"choice": pb.ChoiceList(choices=args.choice)}
    return {}


def _logit_bias(ap, items: list[str]) -> dict:
    bias = {}
    for item in items:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            ap.error(f"--logit-bias wants ID=BIAS, got {item!r}")
    return {"logit_bias": bias} if bias else {}


def _json(msg) -> str:
    from google.protobuf import json_format

    return json.dumps(json_format.MessageToDict(msg), separators=(",", ":"))


def _error(e: KvgenError) -> dict:
    out = {"code": e.code().name, "message": e.details()}
    if e.field_violations:
        out["fieldViolations"] = [{"field": v.field, "description": v.description} for v in e.field_violations]
    if e.retry_delay is not None:
        out["retryDelay"] = e.retry_delay
    return out


if __name__ == "__main__":
    sys.exit(main())
