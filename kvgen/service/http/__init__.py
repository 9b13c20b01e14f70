"""The OpenAI-compatible HTTP API (HTTP_PORT): /v1/chat/completions, /v1/completions, /v1/models,
served by aiohttp on the gRPC server's event loop, over the same engine.

params.py reads a request body into kvgen.v1 GenerateRequests (so both APIs share one set of
checks and one mapping onto the engine, service/convert.py); fanout.py runs a call's choices on
the engine; render.py writes OpenAI's JSON and stream chunks; routes.py holds the handlers;
errors.py writes OpenAI's error JSON; app.py is the server (auth, metrics, traces, drain).
"""
