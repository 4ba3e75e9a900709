"""OpenAI wire format at the edge: request validation into core types, and response/chunk/error builders."""
from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.errors import InvalidRequestError, MFSError, ModelNotFoundError
from orchestrator.core.family import FamilySpec
from orchestrator.serve import request_fields as fields
from orchestrator.serve.tokenizer import FamilyTokenizer, TokenizerError
from orchestrator.core.types import (
    FinishReason, MemberName, MemberSpan, Profile, Request, RequestId, RouteDecision, SamplingParams,
)

MAX_STOP_STRINGS = 4
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
SEED_RANGE = (-2**63, 2**64 - 1)         # int64 or uint64, whichever the client's SDK speaks
COMPLETION_DEFAULT_MAX_TOKENS = 16       # OpenAI's default for /v1/completions
_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(slots=True)
class ParsedRequest:
    """A validated OpenAI request: the core Request plus what only the edge needs (stream shape, stops)."""

    kind: str                          # "chat" | "completion"
    request: Request
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    stop_strings: tuple[str, ...]
    ignored_fields: list[str] = field(default_factory=list)     # unknown names, accepted without effect
    return_token_ids: bool = False     # vLLM's field: token_ids per choice, prompt_token_ids once
    created_s: int = field(default_factory=lambda: int(time.time()))


# ----------------------------------------------------------------------------- validation
def parse_request(kind: str, body: Any, *, tokenizer: FamilyTokenizer, family: FamilySpec,
                  session_id: str | None, tenant: str | None = None) -> ParsedRequest:
    """Validates an OpenAI body; raises InvalidRequestError / ModelNotFoundError naming the field.
    tenant: the digest of the request's API key when the server has keys: it salts the prefix hashes and the
    session key, so one key's requests never share (or learn of) another's cache."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", None)
    ignored = fields.check_fields(kind, body)
    for name in ("model", "user", "cache_salt"):
        fields.bounded_text(body, name)
    model, pinned = _model(body, family)
    prompt_ids, context_tokens = _prompt(kind, body, tokenizer, family, model, pinned)
    n = _opt(body, "n", int)
    if n is not None and n != 1:
        raise InvalidRequestError("only n=1 is supported", "n")
    logprobs, top_logprobs = _logprobs(kind, body)
    sampling = _sampling(kind, body, prompt_ids, context_tokens, model, top_logprobs, tokenizer.vocab_size)
    stream, include_usage = _stream_options(body)
    user = _opt(body, "user", str)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request = Request(
        request_id=RequestId(f"{prefix}-{uuid.uuid4().hex}"), prompt_token_ids=prompt_ids, sampling=sampling,
        arrival_s=time.monotonic(), session_id=session_digest(session_id or user, tenant), pinned_member=pinned,
        profile=_profile(body), cache_salt=tenant_salt(tenant, _cache_salt(body)),
    )
    return ParsedRequest(kind=kind, request=request, stream=stream, include_usage=stream and include_usage,
                         logprobs=logprobs, top_logprobs=top_logprobs, stop_strings=sampling.stop_strings,
                         ignored_fields=ignored, return_token_ids=bool(_opt(body, "return_token_ids", bool)))


def _model(body: dict, family: FamilySpec) -> tuple[str, MemberName | None]:
    """The model asked for (the family by default) and the member it pins, if it names one."""
    model = _opt(body, "model", str) or family.name
    if model != family.name and model not in family.serving_names:
        why = "only drafts for the larger members" if model in family.member_names else "does not exist"
        raise ModelNotFoundError(f"model {model!r} {why}; use {family.name!r} or one of "
                                 f"{', '.join(family.serving_names)}", "model")
    return model, (MemberName(model) if model != family.name else None)


def _prompt(kind: str, body: dict, tokenizer: FamilyTokenizer, family: FamilySpec, model: str,
            pinned: MemberName | None) -> tuple[list[int], int]:
    """The prompt's token ids and the context they must fit (the pinned member's, else the family's)."""
    context_tokens = family.member(pinned).context_tokens if pinned else family.context_tokens()
    if kind == "chat":
        prompt_ids, field_name = _chat_prompt(body, tokenizer, context_tokens), "messages"
    else:
        prompt_ids, field_name = _completion_prompt(body, tokenizer, context_tokens), "prompt"
    if len(prompt_ids) >= context_tokens:
        raise InvalidRequestError(f"prompt is {len(prompt_ids)} tokens; the context of {model} is "
                                  f"{context_tokens} tokens", field_name)
    return prompt_ids, context_tokens


def _sampling(kind: str, body: dict, prompt_ids: list[int], context_tokens: int, model: str,
              num_top_logprobs: int, vocab_size: int) -> SamplingParams:
    num_prompt_tokens = len(prompt_ids)
    max_tokens, max_field = _max_tokens(body)
    if max_tokens is None:
        remaining = context_tokens - num_prompt_tokens
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, remaining) if kind == "completion" else remaining
    elif num_prompt_tokens + max_tokens > context_tokens:
        raise InvalidRequestError(f"prompt ({num_prompt_tokens} tokens) + {max_field} ({max_tokens}) exceeds "
                                  f"the context of {model} ({context_tokens} tokens)", max_field)
    temperature = _opt_number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise InvalidRequestError("temperature must be in [0, 2]", "temperature")
    top_p = _opt_number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
    top_k = _opt(body, "top_k", int)
    top_k = 0 if top_k is None or top_k == -1 else top_k   # -1 means off (vLLM convention)
    if top_k < 0:
        raise InvalidRequestError("top_k must be >= 0 (or -1 for off)", "top_k")
    min_tokens = _opt(body, "min_tokens", int) or 0
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequestError("min_tokens must be in [0, max_tokens]", "min_tokens")
    seed = _opt(body, "seed", int)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise InvalidRequestError("seed must fit in 64 bits", "seed")
    repetition_penalty = fields.penalty(body, "repetition_penalty", 1.0, 0.01, 100.0)
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        seed=seed, stop_strings=_stop_strings(body.get("stop")),
        stop_token_ids=fields.stop_token_ids(body, vocab_size),
        ignore_eos=bool(_opt(body, "ignore_eos", bool)), min_tokens=min_tokens, num_top_logprobs=num_top_logprobs,
        frequency_penalty=fields.penalty(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=fields.penalty(body, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=repetition_penalty, logit_bias=fields.logit_bias(body, vocab_size),
        penalized_prompt_ids=tuple(sorted(set(prompt_ids))) if repetition_penalty != 1.0 else (),
    )


def _stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage)."""
    stream = bool(_opt(body, "stream", bool))
    options = _opt(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequestError("stream_options.include_usage must be a boolean", "stream_options")
    return stream, include_usage


def _profile(body: dict) -> Profile:
    profile_name = _opt(body, "mfs_profile", str) or Profile.LATENCY.value
    try:
        return Profile(profile_name)
    except ValueError:
        raise InvalidRequestError("mfs_profile must be 'latency' or 'quality'", "mfs_profile") from None


def session_digest(session: str | None, tenant: str | None = None) -> str | None:
    """What the engine keeps for a session key: a fixed-size digest (32 hex characters), never the client's
    string, so its session tables cost the same per entry whatever the clients send."""
    if not session:
        return None
    h = hashlib.blake2b(digest_size=16, person=b"mfs-session")
    h.update((tenant or "").encode())
    h.update(b"\0" + session.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def tenant_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix-hash salt: the API key's digest (fixed length) before the client's own cache_salt, if any."""
    if tenant is None:
        return cache_salt
    return f"key:{tenant}" if cache_salt is None else f"key:{tenant}/{cache_salt}"


def _cache_salt(body: dict) -> str | None:
    cache_salt = _opt(body, "cache_salt", str)
    if cache_salt == "":
        raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
    return cache_salt


def _opt(body: dict, name: str, kind: type) -> Any:
    """An optional field of an exact JSON type (bool is not an int here); None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequestError(f"'{name}' must be {_type_word(kind)}, got {type(value).__name__}", name)
    return value


def _opt_number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"'{name}' must be a number, got {type(value).__name__}", name)
    return float(value)


def _type_word(kind: type) -> str:
    return {str: "a string", int: "an integer", bool: "a boolean", dict: "an object", list: "an array"}[kind]


def _max_tokens(body: dict) -> tuple[int | None, str]:
    """(the limit, the field it came from): max_completion_tokens wins over max_tokens, and both are checked (an
    invalid max_tokens beside a valid max_completion_tokens is a 400 too, as the schema says)."""
    found: tuple[int | None, str] = (None, "max_tokens")
    for name in ("max_completion_tokens", "max_tokens"):
        value = _opt(body, name, int)
        if value is not None:
            if value < 1:
                raise InvalidRequestError(f"'{name}' must be >= 1", name)
            if found[0] is None:
                found = (value, name)
    return found


def _check_text_length(chars: int, tokenizer: FamilyTokenizer, context_tokens: int, field_name: str) -> None:
    """Refuses, before tokenizing it, a prompt text too long for any prompt of context_tokens to hold."""
    limit = tokenizer.max_prompt_chars(context_tokens)
    if chars > limit:
        raise InvalidRequestError(f"prompt text is {chars} characters; a context of {context_tokens} tokens holds "
                                  f"at most {limit}", field_name)


def _completion_prompt(body: dict, tokenizer: FamilyTokenizer, context_tokens: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]           # a batch of one
    if isinstance(prompt, str):
        _check_text_length(len(prompt), tokenizer, context_tokens, "prompt")
        ids = tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        ids = list(prompt)
    elif prompt is None:
        raise InvalidRequestError("'prompt' is required", "prompt")
    else:
        raise InvalidRequestError("'prompt' must be a string or a list of token ids (one prompt only)", "prompt")
    if not ids:
        raise InvalidRequestError("'prompt' must not be empty", "prompt")
    return ids


def _chat_prompt(body: dict, tokenizer: FamilyTokenizer, context_tokens: int) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty array", "messages")
    if len(messages) > fields.MAX_MESSAGES:
        raise InvalidRequestError(f"'messages' may hold at most {fields.MAX_MESSAGES} messages", "messages")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}] needs a 'role' in {sorted(_CHAT_ROLES)}", "messages")
        rendered.append({"role": message["role"], "content": _message_text(message.get("content"), i)})
    _check_text_length(sum(len(m["content"]) for m in rendered), tokenizer, context_tokens, "messages")
    try:
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    except TokenizerError as exc:
        raise InvalidRequestError(str(exc), "messages") from exc
    if not ids:
        raise InvalidRequestError("'messages' rendered to an empty prompt", "messages")
    return ids


def _message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and len(content) <= fields.MAX_CONTENT_PARTS and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= fields.MAX_NAME_CHARS for s in stops)):
        raise InvalidRequestError(f"'stop' must be a non-empty string or a list of at most "
                                  f"{MAX_STOP_STRINGS} non-empty strings of at most {fields.MAX_NAME_CHARS} "
                                  f"characters", "stop")
    return tuple(stops)


def _logprobs(kind: str, body: dict) -> tuple[bool, int]:
    if kind == "chat":
        wanted = bool(_opt(body, "logprobs", bool))
        top = _opt(body, "top_logprobs", int) or 0
        if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS or (top and not wanted):
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}] and needs "
                                      f"logprobs=true", "top_logprobs")
        return wanted, top
    top = _opt(body, "logprobs", int)
    if top is None:
        return False, 0
    if not 0 <= top <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
    return True, top


# ----------------------------------------------------------------------------- responses
def error_body(exc: MFSError) -> dict[str, Any]:
    code = getattr(exc, "code", None) or exc.error_type
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": code}}


def finish_reason_text(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def mfs_extension(spans: tuple[MemberSpan, ...], route: RouteDecision | None, num_drafted_tokens: int = 0,
                  num_accepted_tokens: int = 0) -> dict[str, Any]:
    """The `mfs` object: which members produced how many tokens, why the first one was chosen, and how many
    tokens a smaller member drafted for it and its members accepted (speculation; 0 and 0 without)."""
    members = [{"member": s.member, "tokens": s.num_tokens} for s in spans]
    return {"members": members, "escalated": len({s.member for s in spans}) > 1,
            "route": None if route is None else {"member": route.member, "reason": route.reason,
                                                 "complexity": route.complexity},
            "speculation": {"drafted_tokens": num_drafted_tokens, "accepted_tokens": num_accepted_tokens}}


def logprob_entry(tokenizer: FamilyTokenizer, token_id: int, logprob: float,
                  top: tuple[tuple[int, float], ...]) -> dict[str, Any]:
    """One token's logprob record in the chat shape; completion_logprobs re-shapes a list of them."""
    text = tokenizer.token_text(token_id)
    entry: dict[str, Any] = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    entry["top_logprobs"] = [{"token": (t := tokenizer.token_text(tid)), "logprob": lp, "bytes": list(t.encode())}
                             for tid, lp in top]
    return entry


def chat_logprobs(entries: list[dict]) -> dict[str, Any]:
    return {"content": entries}


def completion_logprobs(entries: list[dict], text_offset_start: int) -> dict[str, Any]:
    offsets, at = [], text_offset_start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def full_response(parsed: ParsedRequest, model: str, text: str, finish_reason: str | None,
                  logprobs: dict | None, usage_dict: dict, mfs: dict, token_ids: list[int] | None = None,
                  prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    rid = parsed.request.request_id
    if parsed.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": parsed.created_s, "model": model, "choices": [choice],
           "usage": usage_dict, "mfs": mfs}
    _token_ids(parsed, out, choice, token_ids, prompt_token_ids)
    return out


def _token_ids(parsed: ParsedRequest, out: dict, choice: dict, token_ids: list[int] | None,
               prompt_token_ids: list[int] | None) -> None:
    """return_token_ids, where vLLM puts them: token_ids in the choice; prompt_token_ids in the choice
    (completions) or beside the choices (chat)."""
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        (out if parsed.kind == "chat" else choice)["prompt_token_ids"] = prompt_token_ids


def chunk(parsed: ParsedRequest, model: str, *, text: str | None = None, role: bool = False,
          finish_reason: str | None = None, logprobs: dict | None = None, mfs: dict | None = None,
          token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """One streaming chunk with a single choice (chat: delta; completions: text)."""
    if parsed.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": parsed.request.request_id, "object": obj, "created": parsed.created_s, "model": model,
           "choices": [choice]}
    _token_ids(parsed, out, choice, token_ids, prompt_token_ids)
    if mfs is not None:
        out["mfs"] = mfs
    return out


def usage_chunk(parsed: ParsedRequest, model: str, usage_dict: dict) -> dict[str, Any]:
    obj = "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"
    return {"id": parsed.request.request_id, "object": obj, "created": parsed.created_s, "model": model,
            "choices": [], "usage": usage_dict}


def models_list(family: FamilySpec, created_s: int) -> dict[str, Any]:
    ids = [family.name, *family.serving_names]        # a drafts_only member is no model to ask for
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created_s, "owned_by": "mfs",
         "root": name, "parent": None if name == family.name else family.name,
         "max_model_len": family.context_tokens() if name == family.name else family.member(name).context_tokens}
        for name in ids]}
