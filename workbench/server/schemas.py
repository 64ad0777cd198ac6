"""The OpenAI request bodies the server accepts, as pydantic models, and its error body.

Fields a request leaves out take OpenAI's documented defaults, not the Python
API's (which is greedy): `temperature` 1 and `top_p` 1 (`OPENAI_SAMPLING`; the
llama.cpp extensions `top_k` and `min_p` are off unless set, so an omitted field
samples from the model's own distribution as OpenAI does), `max_tokens` 16 for
/v1/completions and, for chat, as many as the context holds (under the server's
`max_tokens_limit`). A request that sets a field gets exactly that value. Fields we
do not know are ignored (clients such as LangChain send `user`, `metadata` ...);
fields we know but cannot honour (`tools`, `suffix`, `draft`) are refused with a 400.
Beyond OpenAI's fields we accept llama.cpp server's `top_k`, `min_p`,
`repeat_penalty` and `grammar` (GBNF). A field named as a `GenerationOptions`
field goes to the engine as it is; the fields declared here carry the HTTP API's
bounds (OpenAI's where it has them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workbench.engine.options import OPTION_NAMES, parse_logit_bias

MAX_CHOICES = 16  # n (times the number of prompts for /v1/completions) per request
MAX_EMBEDDING_INPUTS = 2048  # texts per /v1/embeddings request, as OpenAI allows
# the sampling of a request that leaves these fields out: OpenAI's defaults
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# options passed on as the request wrote them (max_tokens goes through the server's
# limit, stop and logit_bias are converted, logprobs differs per route)
_AS_WRITTEN = tuple(n for n in OPTION_NAMES
                    if n not in ("max_tokens", "stop", "stop_tokens", "logit_bias", "logprobs"))


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        """null means the field's default: OpenAI marks its optional fields nullable, and
        some clients write every field out (`"n": null`, `"stream": null`)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def options(self, *names: str) -> dict[str, Any]:
        """The named fields this request set (None counts as not set)."""
        return {k: getattr(self, k) for k in names
                if k in self.model_fields_set and getattr(self, k) is not None}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        """The message as the chat template wants it: `developer` is `system`, text parts
        joined."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role,
                "content": content or ""}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


Stop = str | Annotated[list[str], Field(max_length=16)] | None
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Sampling(_Request):
    """Sampling fields shared by chat and text completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Annotated[int, Field(ge=-1)] | None = None  # -1: a random seed, as in llama.cpp
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # llama.cpp server's extensions
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0)] | None = None
    grammar: str | None = None
    # speculative decoding is the server's choice (`serve(..., draft=)`), not a request's:
    # refused, so that a client that asks for it is told rather than silently served
    draft: Any = None
    draft_tokens: Any = None

    def sampling(self) -> dict[str, Any]:
        """Engine options: OpenAI's sampling defaults, then the fields this request set."""
        for name in ("draft", "draft_tokens"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name}: a request cannot choose a draft model (the "
                               "server's draft model, if it was started with one, serves "
                               "every request)", param=name, code="unsupported_parameter")
        options = {**OPENAI_SAMPLING,
                   **self.options(*(n for n in _AS_WRITTEN if n in type(self).model_fields))}
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(stops):  # "" would stop before the first character: dropped, as llama.cpp does
            options["stop"] = [s for s in stops if s]
        if self.logit_bias:
            try:
                options["logit_bias"] = parse_logit_bias(self.logit_bias)
            except (TypeError, ValueError) as exc:
                raise APIError(400, str(exc), param="logit_bias") from None
        if self.grammar is not None:
            options["grammar"] = self.grammar
        return options


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    # vLLM's extension: the messages end with an assistant message whose text the model
    # continues (an answer cut at max_tokens) instead of starting a new turn
    continue_final_message: bool = False


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1)] \
        | Annotated[list[int], Field(min_length=1)] \
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None


class EmbeddingRequest(_Request):
    model: str
    # OpenAI's bounds: 2048 texts, or token-id arrays of at most 2048 ids (one or 2048
    # of them); on every shape, so that 100,000 texts fail on their count at once rather
    # than as 200,000 items that are not integers
    input: str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] \
        | Annotated[list[int], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] \
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
