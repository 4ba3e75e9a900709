"""The family's tokenizer at the edge: encode prompts, render chat templates, decode streams with stop strings.

One tokenizer serves the whole family (members share it; family.incompatible_pairs() says otherwise).
Uses the `tokenizers` library and jinja2 directly: no transformers at run time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from orchestrator.core.complexity import ComplexityEstimator, estimator_for_vocab
from orchestrator.core.family import FamilySpec


class TokenizerError(ValueError):
    pass


class FamilyTokenizer:
    def __init__(self, checkpoint_dir: Path):
        from tokenizers import Tokenizer

        tokenizer_file = checkpoint_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file}: missing")
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config_file = checkpoint_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._chat_template = env.from_string(template) if isinstance(template, str) else None
        self.vocab_size = self._tokenizer.get_vocab_size()
        self._max_token_bytes: int | None = 0          # 0: not computed yet (max_token_bytes)

    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token can stand for, when that is bounded: a byte-level BPE with no
        normalizer whose added tokens absorb no whitespace (each byte of the text then lands in exactly one
        token, so a text of n bytes has at least n / max_token_bytes tokens). None for any other tokenizer."""
        if self._max_token_bytes == 0:
            self._max_token_bytes = _max_token_bytes(json.loads(self._tokenizer.to_str()))
        return self._max_token_bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's text for messages (apply_chat_template tokenises it)."""
        if self._chat_template is None:
            raise TokenizerError("this family's tokenizer has no chat_template: use /v1/completions")
        try:
            return self._chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self._tokenizer.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def vocab_texts(self) -> list[str]:
        """Every id's text, index = id (what the core's complexity estimator reads)."""
        return [self.token_text(token_id) for token_id in range(self.vocab_size)]


def family_tokenizer(family: FamilySpec) -> FamilyTokenizer:
    """The family's one tokenizer (its smallest member's files; every member has the same)."""
    return FamilyTokenizer(family.members[0].checkpoint_dir)


def complexity_estimator(tokenizer: FamilyTokenizer) -> ComplexityEstimator:
    """The estimator the scheduler routes with, for this tokenizer's vocabulary."""
    return estimator_for_vocab(tokenizer.vocab_texts())


def family_estimator(family: FamilySpec) -> ComplexityEstimator:
    """complexity_estimator of the family's tokenizer (what EngineCore.build takes as its estimator source)."""
    return complexity_estimator(family_tokenizer(family))


def _max_token_bytes(spec: dict) -> int | None:
    """max_token_bytes from a tokenizer.json: the longest vocab entry (byte-level: one character per byte) or
    added token, or None when the tokenizer is not a plain byte-level BPE."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or spec.get("normalizer") is not None or pre.get("type") != "ByteLevel":
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("normalized") or t.get("single_word") for t in added):
        return None
    vocab = model.get("vocab") or {}
    longest = max((len(token) for token in vocab), default=0)
    return max([longest, *(len(t["content"].encode()) for t in added)]) or None


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str):
    raise TokenizerError(message)


@dataclass(slots=True)
class IncrementalDecoder:
    """Turns a growing token list into text deltas and applies stop strings (OpenAI semantics: the stop
    string itself is not returned). Holds back a tail that could still become a stop string.

    Decodes a window, not the whole answer (decoding the whole answer per token was O(answer length) of work on
    the event loop): `read_offset` is where the text decoded so far ends; `prefix_offset` starts the last decoded piece,
    decoded again with the new tokens so byte-level merges across the boundary come out as a full decode would.
    The window moves on only when it ends on a whole character (an incomplete UTF-8 sequence decodes to U+FFFD).
    """

    tokenizer: FamilyTokenizer
    stop_strings: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""                   # decoded text of token_ids[:read_offset]
    prefix_offset: int = 0
    read_offset: int = 0
    emitted_chars: int = 0
    stopped: bool = False

    def _advance(self) -> bool:
        """Decodes the window; False while it ends inside a character (wait for the next token)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        window_text = decode(self.token_ids[self.prefix_offset:])
        if window_text.endswith("\ufffd"):
            return False
        self.text += window_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return True

    def push(self, new_token_ids: list[int]) -> str:
        """Adds tokens; returns the new text safe to emit. Sets .stopped when a stop string appeared."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        if not self._advance():
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        text = self.text
        for stop in self.stop_strings:
            at = text.find(stop, max(0, self.emitted_chars - len(stop) + 1))
            if at != -1:
                self.stopped = True
                delta = text[self.emitted_chars:at]
                self.emitted_chars = at
                return delta
        holdback = max((len(s) - 1 for s in self.stop_strings), default=0)
        safe_end = max(self.emitted_chars, len(text) - holdback)
        delta = text[self.emitted_chars:safe_end]
        self.emitted_chars = safe_end
        return delta

    def flush(self) -> str:
        """At the end of the stream: the held-back tail (no stop string matched), an incomplete character as
        U+FFFD as a full decode gives it."""
        if self.stopped:
            return ""
        decode = self.tokenizer.decode
        tail = decode(self.token_ids[self.prefix_offset:])[len(decode(self.token_ids[self.prefix_offset:self.read_offset])):]
        text = self.text + tail
        delta = text[self.emitted_chars:]
        self.emitted_chars = len(text)
        return delta
