"""OpenAI-style request models (strict types) and error bodies; refengine/server/checks.py checks them against
what the engine can honour.

Types are strict: `max_tokens: true` or `stream: "yes"` is a 400 naming the field, not a coercion (an int
for a float field is accepted, as JSON does not tell 1 from 1.0). Unknown fields are accepted and ignored
(extra="allow"): clients (the openai package, lm-eval) send fields that do not change the output, such as
`user` or `metadata`. Sampling fields map onto SamplingParams: `temperature` (0..2, 0 = greedy), `top_p`,
`seed`, vLLM's `top_k` (-1 or 0 = off), and `n` choices per prompt (choice j seeded seed + j). vLLM's
`return_token_ids` adds the generated ids (`token_ids`) and the prompt's (`prompt_token_ids`) to the answer.
A known field whose value would change the output in a way the engine cannot honour (penalties, a non-empty
logit_bias, min_p when sampling, best_of other than n, tools, response_format, ...) is a 400 naming it
(checks.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# Used when the tokenizer ships no chat template: ChatML, the format of Qwen3's own template without tools.
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # /v1/chat/completions without max_tokens (OpenAI: up to the context)
CHAT_ROLES = ("system", "developer", "user", "assistant")  # tool / function messages need tools: unsupported


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending field (param), optional extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(message: str) -> ApiError:
    return ApiError(500, message, None, "internal_server_error", "internal_error")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's; -1 or 0: off
    min_p: float | None = None  # vLLM's; not implemented: only 0 when sampling (greedy never drops the argmax)
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extensions
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool | None = None  # each choice's generated ids (token_ids) and its prompt's


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    echo: bool | None = None  # vLLM's
    add_generation_prompt: bool | None = None  # vLLM's
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
