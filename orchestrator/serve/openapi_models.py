"""The request bodies of both generation endpoints as pydantic models, for the published /openapi.json only.

The handlers validate by hand (api_schema.py, request_fields.py: no model is built per request); these models
say the same thing to schema-driven tools, and tests/test_openapi_schema.py checks the two agree field by field.
Unknown fields are accepted and ignored (additionalProperties: true), as docs/API.md says.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.serve.request_fields import (MAX_CONTENT_PARTS, MAX_LOGIT_BIAS_ENTRIES, MAX_MESSAGES,
                                               MAX_NAME_CHARS, MAX_STOP_TOKEN_IDS)

_STOP_MAX = 4            # api_schema.MAX_STOP_STRINGS (not imported: api_schema imports the tokenizer)
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
# the JSON parser keeps an integer exact up to 64 bits; one past it is a float every integer field refuses
# (docs/API.md, "Limits"): the schema says so instead of promising any integer
INT_MAX = 2**64 - 1
TokenId = Annotated[int, Field(ge=0, le=INT_MAX)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Name | None = Field(None, description="the family name (routed) or a member name (pinned)")
    max_tokens: Annotated[int, Field(ge=1, le=INT_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT_MAX)] | None = Field(
        None, description="wins over max_tokens")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] | None = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT_MAX)] | None = Field(None, description="0 or -1: off")
    seed: Annotated[int, Field(ge=-2**63, le=2**64 - 1)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=_STOP_MAX)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: Literal[1] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Name | None = Field(None, description="session affinity key when there is no X-Session-ID header")
    ignore_eos: bool | None = False
    min_tokens: Annotated[int, Field(ge=0, le=INT_MAX)] | None = Field(None, description="at most max_tokens")
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)] | None = None
    mfs_profile: Literal["latency", "quality"] | None = "latency"
    return_token_ids: bool | None = Field(False, description="vLLM's: the generated token ids beside the text "
                                                "(token_ids per choice; prompt_token_ids once)")
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100)] | None = 1.0
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,12}$")],
                               Annotated[float, Field(ge=-100, le=100)]],
                          # keys that are no token id are refused: pydantic's patternProperties alone allows them
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES,
                                json_schema_extra={"additionalProperties": False})] | None = Field(
        None, description="token id (in the vocabulary) -> bias added to its logit")
    metadata: dict[str, Any] | None = Field(None, description="accepted, no effect")
    store: bool | None = Field(None, description="accepted, no effect")
    service_tier: str | None = Field(None, description="accepted, no effect")
    parallel_tool_calls: bool | None = Field(None, description="accepted, no effect (tools are not supported)")


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(None, description="needs logprobs=true")


class CompletionRequest(_Common):
    """POST /v1/completions."""
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)])
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a route whose handler reads the body itself: its request body's schema, with the
    nested models inlined (so the schema stands alone inside the operation)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    content = {"application/json": {"schema": _inline(schema, definitions)}}
    return {"requestBody": {"required": True, "content": content}}


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(definitions[ref.removeprefix("#/$defs/")], definitions)
        return {key: _inline(value, definitions) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline(value, definitions) for value in node]
    return node
