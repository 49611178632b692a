"""OpenAI-style request models, their checks against what the engine can honour, and error bodies.

Unknown fields are accepted and ignored (extra="allow"): clients (the openai package, lm-eval) send fields
that mean nothing under greedy decoding, such as `seed` and `user`. A field whose value would change the
output in a way the engine cannot honour (temperature > 0, n > 1, penalties, a non-empty logit_bias, ...) is
an ApiError (HTTP 400, `invalid_request_error`) naming it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from refengine.request import MAX_LOGPROBS

# Used when the tokenizer ships no chat template: ChatML, the format of Qwen3's own template without tools.
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # /v1/chat/completions without max_tokens (OpenAI: up to the context)


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending field (param)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(message: str) -> ApiError:
    return ApiError(500, message, None, "internal_server_error", "internal_error")


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text":
                raise ApiError(
                    400, f"message content part of type {p.get('type')!r}: only text is supported", "messages"
                )
            parts.append(str(p.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


def check_common(r: _Common) -> None:
    """400 naming the first field the engine cannot honour; a no-op for the defaults clients send."""
    if r.temperature not in (None, 0):
        raise ApiError(
            400, f"temperature={r.temperature}: only greedy decoding (temperature 0) is supported", "temperature"
        )
    if r.top_p is not None and not 0 < r.top_p <= 1:
        raise ApiError(400, f"top_p={r.top_p} must be in (0, 1]", "top_p")
    if r.n not in (None, 1):
        raise ApiError(400, f"n={r.n}: only n=1 is supported (greedy gives one answer)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(r, name) not in (None, 0):
            raise ApiError(400, f"{name}={getattr(r, name)}: penalties are not supported (use 0)", name)
    if r.logit_bias:
        raise ApiError(400, "logit_bias is not supported (send it empty or omit it)", "logit_bias")
    if r.max_tokens is not None and r.max_tokens < 0:
        raise ApiError(400, f"max_tokens={r.max_tokens} must be >= 0", "max_tokens")


def check_completion(r: CompletionRequest) -> None:
    check_common(r)
    if r.best_of not in (None, 1):
        raise ApiError(400, f"best_of={r.best_of}: only best_of=1 is supported", "best_of")
    if r.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs={r.logprobs} must be in 0..{MAX_LOGPROBS}", "logprobs")
    if r.max_tokens == 0 and not r.echo:
        raise ApiError(400, "max_tokens=0 needs echo=true (scoring the prompt)", "max_tokens")
    if r.max_tokens == 0 and r.stream:
        raise ApiError(400, "max_tokens=0 (prompt scoring) cannot stream", "stream")


def check_chat(r: ChatCompletionRequest) -> None:
    check_common(r)
    if r.top_logprobs is not None and not 0 <= r.top_logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs={r.top_logprobs} must be in 0..{MAX_LOGPROBS}", "top_logprobs")
    if r.max_tokens == 0 or r.max_completion_tokens == 0:
        raise ApiError(400, "max_tokens must be >= 1 for chat", "max_tokens")
    if not r.messages:
        raise ApiError(400, "messages must not be empty", "messages")


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return [s for s in stops if s]


def prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
