"""The OpenAI request bodies this server takes: every field honoured, or refused by name.

Bodies are validated strictly (a string is not a number, "yes" is not a
boolean) and a field outside the API is refused as unknown. Fields of
OpenAI's API that paperback does not implement (tools, audio, suffix, ...)
are listed in REFUSED: a request that sets one to anything but its neutral
value gets a 400 naming it, never a silent default. Fields that identify
the caller and change no output (user, safety_identifier, prompt_cache_key,
metadata) are accepted, as OpenAI's docs describe them. vLLM's extensions
(top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids) are honoured
too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from paperback.errors import PaperbackError
from paperback.generation.sampling import SamplingParams
from paperback.generation.structured import Grammar

# Field -> (why, the values that ask for nothing and so pass).
REFUSED: dict[str, tuple[str, tuple]] = {
    "tools": ("tool calling is not supported", (None, [])),
    "tool_choice": ("tool calling is not supported", (None, "none")),
    "parallel_tool_calls": ("tool calling is not supported", (None,)),
    "functions": ("function calling is not supported", (None, [])),
    "function_call": ("function calling is not supported", (None, "none")),
    "audio": ("audio output is not supported", (None,)),
    "modalities": ("only text output is supported", (None, ["text"])),
    "prediction": ("predicted outputs are not supported", (None,)),
    "suffix": ("suffix (insertion) is not supported", (None, "")),
    "reasoning_effort": ("this model has no reasoning effort setting", (None,)),
    "verbosity": ("verbosity is not supported", (None,)),
    "web_search_options": ("web search is not supported", (None,)),
    "store": ("stored completions are not supported", (None, False)),
    "service_tier": ("service tiers are not supported", (None, "auto", "default")),
    "moderation": ("moderation is not supported", (None,)),
    "prompt_cache_options": ("prompt caching is automatic here and has no options", (None,)),
    "prompt_cache_retention": ("prompt caching is automatic here and has no retention setting", (None,)),
}


def _refuse_unsupported(data: Any, fields: set[str]) -> Any:
    if isinstance(data, dict):
        for name in fields & data.keys():
            why, neutral = REFUSED[name]
            if not any(data[name] == v and type(data[name]) is type(v) for v in neutral):
                raise ValueError(f"'{name}' is not supported: {why}")
    return data


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Literal[False] = False


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> Grammar | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Grammar.json_object()
        if self.json_schema is None:
            raise PaperbackError("response_format of type json_schema needs its json_schema")
        return Grammar.json_schema(self.json_schema.schema_ or {})


class _Sampling(_Strict):
    """The sampling fields chat and completions share (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def sampling_params(self, max_tokens: int, stop_token_ids=(), logprobs: int | None = None,
                        prompt_logprobs: int | None = None, output_kind: str = "final") -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise PaperbackError("stream_options is only allowed with stream: true")
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise PaperbackError(f"logit_bias keys must be token ids, got '{key}'")
            bias[int(key)] = value
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        top_k = self.top_k or 0
        if top_k < -1:
            raise PaperbackError("top_k must be -1 or 0 (off) or a positive number of tokens")
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=max(top_k, 0),
            min_p=self.min_p or 0.0, seed=self.seed, stop=tuple(stop), ignore_eos=self.ignore_eos, n=self.n,
            stop_token_ids=(*stop_token_ids, *(self.stop_token_ids or ())),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured=self.response_format.grammar() if self.response_format else None, output_kind=output_kind)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)
    suffix: Any = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        return _refuse_unsupported(data, {"suffix"})

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"'best_of' is not supported: best_of {self.best_of} differs from n {self.n} (this "
                             f"server returns every completion it samples)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice group, as OpenAI takes a list of prompts."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    audio: Any = None

    @model_validator(mode="after")
    def _supported(self):
        if self.role in ("tool", "function"):
            raise ValueError(f"'{self.role}' messages are not supported: tool calling is not supported")
        for name in ("tool_calls", "tool_call_id", "function_call", "audio"):
            if getattr(self, name) is not None:
                raise ValueError(f"'{name}' is not supported in messages")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        self.text()  # content parts are checked here, while the request is validated
        return self

    def text(self) -> str:
        """The message's text: a string, or its text parts joined by newlines (as vLLM joins them)."""
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        texts = []
        for part in self.content:
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part type '{kind}' is not supported: this server takes text parts only")
            try:
                texts.append(TextPart.model_validate(part).text)
            except ValidationError as exc:
                problem = exc.errors()[0]
                where = ".".join(map(str, problem["loc"]))
                raise ValueError(f"a text content part: {where}: {problem['msg']}") from None
        return "\n".join(texts)

    def for_template(self) -> dict:
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # refused unless neutral
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        return _refuse_unsupported(data, set(REFUSED) - {"suffix"})

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1")
        return self


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
