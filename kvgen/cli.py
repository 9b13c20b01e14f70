"""`kvgen`: stream text from a kvgen server.

    kvgen "Once upon a time" --max-new-tokens 64
    kvgen --chat "What is the capital of France?" --temperature 0
    kvgen --info
    kvgen --info --target host:443 --ca-file ca.pem --cert-file me.pem --key-file me.key
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from kvgen.client import Client


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
    ap.add_argument("--info", action="store_true", help="print the served model's info and exit")
    ap.add_argument("--api-key", default=os.environ.get("API_KEY", ""))
    ap.add_argument("--tls", action="store_true", help="connect with TLS, verifying the server by the system's roots")
    ap.add_argument("--ca-file", help="PEM CA that signed the server's certificate (implies --tls)")
    ap.add_argument("--cert-file", help="PEM client certificate, for a server that requires one (with --key-file)")
    ap.add_argument("--key-file", help="PEM private key of --cert-file")
    args = ap.parse_args(argv)
    if bool(args.cert_file) != bool(args.key_file):
        ap.error("--cert-file and --key-file go together")
    client = Client(args.target, args.api_key, tls=args.tls, ca_file=args.ca_file, cert_file=args.cert_file,
                    key_file=args.key_file)
    try:
        if args.info:
            print(client.model_info())
            return 0
        if args.prompt is None:
            ap.error("a prompt is required")
        prompt = args.prompt
        if args.chat:
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}]
        sampling = {k: v for k, v in {
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "repetition_penalty": args.repetition_penalty, "seed": args.seed,
        }.items() if v is not None}
        last = None
        for msg in client.stream(prompt, stop_strings=args.stop, **sampling):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            last = msg
        sys.stdout.write("\n")
        if last is not None:
            u = last.usage
            print(f"[{last.finish_reason and _reason(last.finish_reason)}; prompt {u.prompt_tokens}, "
                  f"completion {u.completion_tokens}, cached {u.cached_tokens} tokens; "
                  f"ttft {last.timings.time_to_first_token_ms:.0f} ms, total {last.timings.total_ms:.0f} ms]",
                  file=sys.stderr)
        return 0
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _reason(value: int) -> str:
    from kvgen.v1 import generate_pb2 as pb

    return pb.FinishReason.Name(value)


if __name__ == "__main__":
    sys.exit(main())
