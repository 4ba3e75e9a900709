"""Which request fields MFS honours, refuses or ignores, and the checks of the penalty and logit_bias fields.

The rule (docs/API.md "Request fields"): a field MFS implements is checked and honoured; a field of the OpenAI
or vLLM API that MFS does not implement is refused with a 400 naming it unless it carries its neutral value
(null, false, 1, "text", ...), so a client never silently loses a behaviour it asked for; any other name is
accepted and ignored (as vLLM does), and the answer lists it in the X-MFS-Ignored-Fields header.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.types import SamplingParams

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 16
MAX_NAME_CHARS = 512               # model, user, cache_salt, each stop string
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
MAX_IGNORED_IN_HEADER = 16
IGNORED_FIELDS_HEADER = "X-MFS-Ignored-Fields"

_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "stop_token_ids", "n", "stream", "stream_options", "user", "ignore_eos", "min_tokens", "cache_salt",
           "mfs_profile", "return_token_ids", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "logprobs",
           # accepted without effect: bookkeeping fields of the OpenAI API that change no output
           "metadata", "store", "service_tier", "parallel_tool_calls"}
HONOURED = {"chat": _COMMON | {"messages", "top_logprobs"},
            "completion": _COMMON | {"prompt"}}


def _absent(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _one(value: Any) -> bool:
    return value is None or (type(value) is int and value == 1)


def _zero(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and value == 0)


# field -> what its neutral value is (the only value MFS accepts for a feature it does not implement)
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "tools": _absent, "functions": _absent, "audio": _absent, "prediction": _absent,
    "web_search_options": _absent, "reasoning_effort": _absent, "echo": _absent, "suffix": _absent,
    "guided_json": _absent, "guided_regex": _absent, "guided_choice": _absent, "guided_grammar": _absent,
    "guided_decoding_backend": _absent, "structured_outputs": _absent, "use_beam_search": _absent,
    "prompt_logprobs": _zero, "truncate_prompt_tokens": _absent, "chat_template": _absent,
    "chat_template_kwargs": _absent, "documents": _absent, "continue_final_message": _absent,
    "include_stop_str_in_output": _absent, "min_p": _zero, "priority": _zero, "best_of": _one,
    "tool_choice": lambda v: v is None or v == "none", "function_call": lambda v: v is None or v == "none",
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": lambda v: v is None or v == ["text"],
    "add_generation_prompt": lambda v: v is None or v is True,
    "length_penalty": lambda v: v is None or (type(v) in (int, float) and v == 1),
}


# the bookkeeping fields accepted without effect still have the OpenAI API's types (a wrong one: 400 naming it)
NO_EFFECT_TYPES: dict[str, tuple[type, str]] = {"metadata": (dict, "an object"), "store": (bool, "a boolean"),
                                                "service_tier": (str, "a string"),
                                                "parallel_tool_calls": (bool, "a boolean")}


def check_fields(kind: str, body: dict) -> list[str]:
    """Refuses a set unimplemented feature (400 naming it) and a bookkeeping field of the wrong type; returns the
    names accepted and ignored."""
    ignored = []
    honoured = HONOURED[kind]
    for name, value in body.items():
        typed = NO_EFFECT_TYPES.get(name)
        if typed is not None and value is not None and not isinstance(value, typed[0]):
            raise InvalidRequestError(f"'{name}' must be {typed[1]}, got {type(value).__name__}", name)
        neutral = _NEUTRAL.get(name)
        if neutral is not None and not neutral(value):
            raise InvalidRequestError(f"'{name}' is not supported by this server (only its neutral value is "
                                      f"accepted; docs/API.md lists what MFS implements)", name)
        if name not in honoured and neutral is None:
            ignored.append(name)
    return ignored


def ignored_header(ignored: list[str]) -> dict[str, str]:
    """The response header naming ignored fields (percent-encoded, at most MAX_IGNORED_IN_HEADER names)."""
    if not ignored:
        return {}
    names = [quote(name[:64], safe="") for name in ignored[:MAX_IGNORED_IN_HEADER]]
    return {IGNORED_FIELDS_HEADER: ",".join(names)}


def penalty(body: dict, name: str, neutral: float, low: float, high: float, low_open: bool = False) -> float:
    """An optional finite number in [low, high] ((low, high] with low_open)."""
    value = body.get(name)
    if value is None:
        return neutral
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"'{name}' must be a number, got {type(value).__name__}", name)
    value = float(value)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidRequestError(f"'{name}' must be in {bracket}{low:g}, {high:g}]", name)
    return value


def logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...) sorted by id."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequestError("'logit_bias' must be an object of token id -> bias", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias")
    entries = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12) or int(key) >= vocab_size:
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key[:32]!r}",
                                      "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidRequestError("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        entries[int(key)] = float(bias)
    return tuple(sorted(entries.items()))


def stop_token_ids(body: dict, vocab_size: int) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if (not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS
            or not all(type(t) is int and 0 <= t < vocab_size for t in value)):
        raise InvalidRequestError(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in "
                                  f"[0, {vocab_size})", "stop_token_ids")
    return tuple(value)


def bounded_text(body: dict, name: str) -> None:
    """Short identifier-like strings (model, user, cache_salt) stay under MAX_NAME_CHARS."""
    value = body.get(name)
    if isinstance(value, str) and len(value) > MAX_NAME_CHARS:
        raise InvalidRequestError(f"'{name}' must be at most {MAX_NAME_CHARS} characters", name)


def refuse_unsupported_sampling(sampling: SamplingParams) -> None:
    """The Triton engine's check: a 400 naming the first penalty, bias, top-logprobs count or min_tokens set to a
    non-neutral value. MFS's Triton client (engines/triton/client.py) sends temperature, top-k, top-p, seed and
    the end id, and reads back one logprob per token; the python-backend model of the local engine reads no more,
    so penalties and a bias would be silently lost, top logprobs would come back empty, and an EOS sampled before
    min_tokens (which Triton does not ban) would be returned as text."""
    for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("logit_bias", ()), ("num_top_logprobs", 0), ("min_tokens", 0)):
        if getattr(sampling, name) != neutral:
            field = {"num_top_logprobs": "top_logprobs"}.get(name, name)
            what = ("'top_logprobs' (chat) / 'logprobs' above 0 (completions)" if field == "top_logprobs"
                    else f"'{field}'")
            raise InvalidRequestError(f"{what} is not supported with the Triton engine (only its neutral value); "
                                      f"the local engine implements it", field)
