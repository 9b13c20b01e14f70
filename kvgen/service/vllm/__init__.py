"""vLLM's gRPC worker service (`vllm.grpc.engine.VllmEngine`, from the smg-grpc-proto package)
over kvgen's engine, beside kvgen.v1 on the same server, so a gateway that speaks it (smg's
`grpc://` workers) routes to kvgen: it tokenizes and applies the chat template itself, sends
token ids, and reads loads and the prefix cache's events to route by cache.

sampling.py   the wire's SamplingParams -> the engine's (refusing what the engine lacks)
tokenizer.py  GetTokenizer's bundle: the engine's tokenizer written out as HF files, zipped
kv_events.py  the prefix cache's events (engine/kv/events.py) -> KvEventBatch
servicer.py   the RPCs, mapping the wire to the engine and back
"""
