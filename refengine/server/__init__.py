"""OpenAI-compatible HTTP server for refengine (`refengine serve`; needs the `serve` extra: fastapi, uvicorn).

app.py routes, loop.py the engine thread, protocol.py request checks and error bodies, text.py detokenizing
and stop strings, scoring.py prompt logprobs, metrics.py Prometheus text, serve.py startup, loadtest.py a
stdlib load client (`refengine serve-bench`)."""
