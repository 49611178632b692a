"""OpenAI-compatible HTTP server for refengine (`refengine serve`; needs the `serve` extra; docs/SERVING.md).

app.py routes, guard.py the Host / API-key / body-size middleware, config.py ServerConfig, checks.py request
parsing and checks (off the event loop), protocol.py request models and error bodies, generate.py one choice
to the end or as SSE, text.py detokenizing and stop strings, loop.py the engine thread, scoring.py prompt
logprobs, metrics.py Prometheus text, serve.py startup and graceful shutdown, loadtest.py and soak.py a
stdlib load client (`refengine serve-bench`, `--soak`)."""
