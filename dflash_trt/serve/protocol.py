"""OpenAI request bodies (pydantic) and OpenAI-style error bodies.

Only what the runtime can honour is accepted: a parameter we cannot implement (n > 1,
logprobs, penalties, echo, tools) is a 400 naming it, never silently ignored. Fields the
OpenAI API defines but that do not change the output (user, metadata, ...) are accepted and ignored.
Extensions (as in vLLM): top_k, ignore_eos, stop_token_ids, return_token_ids, chat_template_kwargs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)


class APIError(Exception):
    """An error with its HTTP status and OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)  # extension; 0 = off (-1 also means off, as in vLLM)
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = None
    n: StrictInt = 1
    ignore_eos: bool = False  # extension
    stop_token_ids: list[StrictInt] | None = None  # extension: stop at these ids too (besides the model's EOS)
    return_token_ids: bool = False  # extension: token ids next to the text
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    logit_bias: dict | None = None
    user: str | None = None

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, v):
        return 0 if v == -1 else v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if self.presence_penalty != 0 or self.frequency_penalty != 0:
            raise ValueError("presence_penalty and frequency_penalty are not supported (must be 0)")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        stops = self.stop_list()
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be at most 4 non-empty strings")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: bool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension, e.g. {"enable_thinking": true} (default false)

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.tools:
            raise ValueError("tools are not supported")
        for m in self.messages:
            m.text()  # raises on non-text parts
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
