"""Request bodies -> checked, tokenized work (run in the app's worker threads, off the event loop).

Order, cheapest first: the body must be UTF-8 JSON (no lone surrogate in any string, nesting bounded by the
parser) whose shape is checked against the count limits before pydantic sees it; then strict types
(protocol.py), then the fields the engine cannot honour, then the model name (404), then tokenization, which
rejects an over-long text from its length alone when it can (Detok.encode)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from refengine.errors import RefEngineError
from refengine.request import MAX_LOGPROBS, SamplingParams
from refengine.server.config import ServerConfig
from refengine.server.protocol import (
    CHAT_DEFAULT_MAX_TOKENS,
    CHAT_ROLES,
    COMPLETION_DEFAULT_MAX_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
)
from refengine.server.text import Detok, PromptTooLong
from refengine.validation import validate_prompt

M = TypeVar("M", bound=BaseModel)
MAX_API_TEMPERATURE = 2.0  # OpenAI's range is 0..2 (the engine takes up to request.MAX_TEMPERATURE)
SEED_SPAN = 2**63  # seeds are 0..2**63 - 1 (SamplingParams); choice j of n takes (seed + j) mod SEED_SPAN


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code=code)


def _no_surrogates(obj: Any) -> None:
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if not x.isascii():
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise bad(f"a string holds a lone UTF-16 surrogate ({x[e.start]!r}): not valid Unicode") from e
        elif isinstance(x, dict):
            stack += list(x.keys()) + list(x.values())
        elif isinstance(x, list):
            stack += x


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not UTF-8 (byte {e.start})") from e
    except RecursionError as e:
        raise bad("the request body nests too deeply") from e
    except ValueError as e:
        raise bad(f"the request body is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise bad(f"the request body must be a JSON object, got {type(obj).__name__}")
    _no_surrogates(obj)
    return obj


def validate(model: type[M], obj: dict[str, Any]) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        param = loc[0] if loc else None
        raise bad(f"{param}: {err.get('msg', 'invalid')}" if param else "invalid request", param) from e


@dataclass
class Prepared:
    """One checked request: token ids of each prompt and what to generate."""

    prompts: list[list[int]]
    params: SamplingParams
    stops: list[str]
    stop_ids: frozenset[int]
    min_tokens: int
    n_logprobs: int | None
    max_tokens: int  # 0: score the prompt only (completions with echo)
    stream: bool
    include_usage: bool
    model: str
    n: int = 1  # choices per prompt
    return_token_ids: bool = False  # vLLM's: token_ids / prompt_token_ids in the answer

    def choice_params(self) -> list[SamplingParams]:
        """The n choices' SamplingParams: seeds seed, seed + 1, ... when seeded (so each choice is
        reproducible and they differ), else all None (each draws its own at admission)."""
        seed = self.params.seed
        if seed is None:
            return [self.params] * self.n
        return [replace(self.params, seed=(seed + j) % SEED_SPAN) for j in range(self.n)]


class Checker:
    """Turns request bodies into Prepared work for one engine (its vocabulary, context, EOS ids)."""

    def __init__(self, cfg: ServerConfig, detok: Detok, vocab: int, max_context: int, eos_ids: frozenset[int]):
        self.cfg, self.detok, self.vocab, self.max_context, self.eos_ids = cfg, detok, vocab, max_context, eos_ids

    def model_of(self, r: Any) -> str:
        if r.model is not None and r.model != self.cfg.model_name:
            raise ApiError(404, f"the model `{r.model}` does not exist", "model", code="model_not_found")
        return self.cfg.model_name

    def ids(self, prompt: str | list[int]) -> list[int]:
        try:
            ids = self.detok.encode(prompt, self.max_context) if isinstance(prompt, str) else prompt
            if len(ids) >= self.max_context:
                raise PromptTooLong(len(ids), self.max_context, 0)
            return validate_prompt(ids, self.vocab)
        except PromptTooLong as e:
            raise bad(str(e), "prompt", "context_length_exceeded") from e
        except (RefEngineError, ValueError) as e:
            raise bad(str(e), "prompt") from e

    def sampling_fields(self, r: _Common) -> dict[str, Any]:
        """temperature, top_p, top_k (vLLM's: -1 or 0 = off) and seed as SamplingParams fields, each range
        checked here so that the 400 names the field as the client spelled it."""
        temperature = 0.0 if r.temperature is None else r.temperature
        if not 0 <= temperature <= MAX_API_TEMPERATURE:  # written so that NaN fails too
            raise bad(f"temperature={r.temperature} must be in [0, {MAX_API_TEMPERATURE:g}]", "temperature")
        top_p = 1.0 if r.top_p is None else r.top_p
        if not 0 < top_p <= 1:
            raise bad(f"top_p={r.top_p} must be in (0, 1]", "top_p")
        top_k = 0 if r.top_k in (None, -1) else r.top_k
        if top_k < 0:
            raise bad(f"top_k={r.top_k} must be >= 1, or -1 / 0 for off", "top_k")
        if r.seed is not None and not 0 <= r.seed < SEED_SPAN:
            raise bad(f"seed={r.seed} must be in 0..2**63 - 1", "seed")
        if temperature > 0 and r.min_p not in (None, 0):  # under greedy min_p never removes the argmax
            raise bad(f"min_p={r.min_p}: not supported when sampling (use 0)", "min_p")
        return {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": r.seed}

    def common(self, r: _Common, max_tokens: int, n_logprobs: int | None) -> Prepared:
        sampling = self.sampling_fields(r)
        n = 1 if r.n is None else r.n
        if not 1 <= n <= self.cfg.max_prompts:
            raise bad(f"n={r.n} must be in 1..{self.cfg.max_prompts}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(r, name) not in (None, 0):
                raise bad(f"{name}={getattr(r, name)}: penalties are not supported (use 0)", name)
        if r.repetition_penalty not in (None, 1):
            raise bad(f"repetition_penalty={r.repetition_penalty}: not supported (use 1)", "repetition_penalty")
        if r.logit_bias:
            raise bad("logit_bias is not supported (send it empty or omit it)", "logit_bias")
        if r.response_format is not None and r.response_format != {"type": "text"}:
            raise bad("response_format: only {'type': 'text'} is supported", "response_format")
        if r.stream_options is not None and not r.stream:
            raise bad("stream_options needs stream=true", "stream_options")
        if max_tokens < 1:
            raise bad(f"max_tokens={max_tokens} must be >= 1", "max_tokens")
        stops = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
        if len(stops) > self.cfg.max_stop_strings:
            raise bad(f"{len(stops)} stop strings: at most {self.cfg.max_stop_strings}", "stop")
        if any(len(s) > self.cfg.max_stop_chars for s in stops):
            raise bad(f"a stop string is longer than {self.cfg.max_stop_chars} characters", "stop")
        stop_ids = list(r.stop_token_ids or [])
        if len(stop_ids) > self.cfg.max_stop_strings:
            raise bad(f"{len(stop_ids)} stop_token_ids: at most {self.cfg.max_stop_strings}", "stop_token_ids")
        if any(not 0 <= t < self.vocab for t in stop_ids):
            raise bad(f"stop_token_ids must be in 0..{self.vocab - 1}", "stop_token_ids")
        min_tokens = r.min_tokens or 0
        if not 0 <= min_tokens <= max_tokens:
            raise bad(f"min_tokens={min_tokens} must be in 0..max_tokens ({max_tokens})", "min_tokens")
        ignore_eos = bool(r.ignore_eos)
        if min_tokens and not ignore_eos:  # the server ends at EOS itself, once min_tokens are out
            stop_ids += self.eos_ids
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                logprobs=0 if n_logprobs is None else max(1, n_logprobs),
                ignore_eos=ignore_eos or min_tokens > 0,
                **sampling,
            )
        except RefEngineError as e:
            raise bad(str(e), "max_tokens") from e
        return Prepared(
            [],
            params,
            [s for s in stops if s],
            frozenset(stop_ids),
            min_tokens,
            n_logprobs,
            max_tokens,
            bool(r.stream),
            bool(r.stream_options and r.stream_options.include_usage),
            self.model_of(r),
            n,
            bool(r.return_token_ids),
        )

    def completion(self, body: bytes) -> tuple[CompletionRequest, Prepared]:
        obj = parse_json(body)
        p = obj.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) > self.cfg.max_prompts:
            raise bad(f"{len(p)} prompts in one request: at most {self.cfg.max_prompts}", "prompt")
        if isinstance(p, list) and len(p) > max(self.cfg.max_prompts, self.max_context):
            raise bad(f"the prompt list has {len(p)} entries: more than the context", "prompt")
        r = validate(CompletionRequest, obj)
        if r.best_of not in (None, r.n or 1):
            raise bad(f"best_of={r.best_of}: only best_of = n is supported (every choice is returned)", "best_of")
        if r.suffix:
            raise bad("suffix is not supported", "suffix")
        if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs={r.logprobs} must be in 0..{MAX_LOGPROBS}", "logprobs")
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if r.max_tokens is None else r.max_tokens
        if max_tokens < 0:
            raise bad(f"max_tokens={max_tokens} must be >= 0", "max_tokens")
        if max_tokens == 0 and not r.echo:
            raise bad("max_tokens=0 needs echo=true (scoring the prompt)", "max_tokens")
        if r.stream and (max_tokens == 0 or r.echo):
            raise bad("echo and max_tokens=0 (prompt scoring) cannot stream", "stream")
        prep = self.common(r, max(max_tokens, 1), r.logprobs)
        prep.max_tokens = max_tokens
        prompts = self.prompts_of(r.prompt)
        if r.stream and len(prompts) != 1:
            raise bad("stream=true takes one prompt", "prompt")
        if len(prompts) * prep.n > self.cfg.max_prompts:
            raise bad(f"{len(prompts)} prompts x n={prep.n} choices: at most {self.cfg.max_prompts}", "n")
        prep.prompts = [self.ids(x) for x in prompts]
        return r, prep

    def prompts_of(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
        """OpenAI's four prompt shapes -> a list of prompts (text or token ids)."""
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad("prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def chat(self, body: bytes, render: Any) -> tuple[ChatCompletionRequest, Prepared]:
        r = validate(ChatCompletionRequest, parse_json(body))
        if not r.messages:
            raise bad("messages must not be empty", "messages")
        for m in r.messages:
            if m.role not in CHAT_ROLES:
                raise bad(f"message role {m.role!r}: use one of {CHAT_ROLES}", "messages")
        for name in ("tools", "functions"):
            if getattr(r, name):
                raise bad(f"{name} (tool calling) is not supported", name)
        for name in ("tool_choice", "function_call"):
            if getattr(r, name) not in (None, "none", "auto"):
                raise bad(f"{name}={getattr(r, name)!r}: tool calling is not supported", name)
        if r.echo:
            raise bad("echo is not supported for chat", "echo")
        if r.add_generation_prompt is False:
            raise bad("add_generation_prompt=false is not supported", "add_generation_prompt")
        if r.chat_template_kwargs:
            raise bad("chat_template_kwargs are not supported", "chat_template_kwargs")
        if r.top_logprobs is not None and not r.logprobs:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        if r.top_logprobs is not None and not 0 <= r.top_logprobs <= MAX_LOGPROBS:
            raise bad(f"top_logprobs={r.top_logprobs} must be in 0..{MAX_LOGPROBS}", "top_logprobs")
        if r.max_tokens == 0 or r.max_completion_tokens == 0:
            raise bad("max_tokens must be >= 1 for chat", "max_tokens")
        max_tokens = r.max_completion_tokens or r.max_tokens or CHAT_DEFAULT_MAX_TOKENS
        prep = self.common(r, max_tokens, (r.top_logprobs or 0) if r.logprobs else None)
        prep.prompts = [self.ids(render(r.messages, True))]
        return r, prep
