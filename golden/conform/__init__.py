"""`python -m golden conform`: the golden gates run against any OpenAI-compatible engine server.

Modules: client (HTTP over the standard library), parse (completions responses -> token ids and top-k rows,
for refengine, vLLM and SGLang), prom (Prometheus /metrics -> speculative counters), source (the pair's
golden prompts, stored or computed live with HF, and the HF scorer), checks (one function per check), cli
(the command and its report). Nothing here imports refengine.
"""
