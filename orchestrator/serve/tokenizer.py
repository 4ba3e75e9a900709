"""The family's tokenizer at the edge: encode prompts, render chat templates, decode streams with stop strings.

One tokenizer serves the whole family (its members share it: MemberSpec.tokenizer_hash seeds the block hashes).
Uses the `tokenizers` library and jinja2 directly: no transformers at run time.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from orchestrator.core.complexity import ComplexityEstimator, estimator_for_vocab
from orchestrator.core.family import FamilySpec


# Characters of prompt text one token may stand for when the tokenizer gives no exact bound (max_token_bytes):
# generous (English averages about 4, code about 3), so only a text far too long for the context is refused untokenized.
GENEROUS_CHARS_PER_TOKEN = 32
_NON_SPACE = re.compile(r"\S")


class TokenizerError(ValueError):
    pass


class FamilyTokenizer:
    def __init__(self, checkpoint_dir: Path):
        from tokenizers import Tokenizer

        tokenizer_file = checkpoint_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file}: missing")
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        # the same tokenizer with special tokens read as text: for what a client typed inside a chat message
        self._text_tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self._text_tokenizer.encode_special_tokens = True
        specials = {t.content: i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}
        self._special_ids = specials
        # leftmost-longest, as the tokenizer matches added tokens
        self._special_pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
            if specials else None
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

    def max_prompt_chars(self, context_tokens: int) -> int:
        """The longest prompt text, in characters, that could still fit context_tokens: a character is at least one
        byte and a token stands for at most max_token_bytes bytes (GENEROUS_CHARS_PER_TOKEN when the tokenizer gives
        no bound). A longer text is refused before it is tokenized."""
        return context_tokens * (self.max_token_bytes() or GENEROUS_CHARS_PER_TOKEN)

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
        """The prompt's ids. The template's own markers (`<|user|>`, `<|eot|>`, ...) are special tokens; a special
        token's text inside a message's content is ordinary text (as Hugging Face's split_special_tokens=True
        encodes it), so a message cannot open or close a turn. The template is rendered twice: as is, and with every
        non-space character of each content masked (same length and whitespace, so a template's trim or strip acts
        alike); the special tokens found in the masked render are the template's, and the text between them is
        encoded with special tokens read as text. Without special text in the content, the ids are those of
        encoding the rendered text whole (the tokenizer encodes the text between special tokens piece by piece)."""
        text = self.render_chat(messages, add_generation_prompt)
        if self._special_pattern is None:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        masked = self.render_chat([{**m, "content": _mask(m.get("content"))} for m in messages], add_generation_prompt)
        if len(masked) != len(text):
            raise TokenizerError("the chat template changes the length of message content: its markers cannot be "
                                 "told from the content")
        ids: list[int] = []
        at = 0
        for marker in self._special_pattern.finditer(masked):
            if text[marker.start():marker.end()] != marker.group():
                raise TokenizerError("the chat template's markers moved with the message content")
            ids += self._text_tokenizer.encode(text[at:marker.start()], add_special_tokens=False).ids
            ids.append(self._special_ids[marker.group()])
            at = marker.end()
        ids += self._text_tokenizer.encode(text[at:], add_special_tokens=False).ids
        return ids

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
    """complexity_estimator of the family's tokenizer (what EngineCore takes as its estimator source)."""
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


def _mask(content):
    """A message's content with every non-space character replaced by NUL (which no special token contains)."""
    return _NON_SPACE.sub("\0", content) if isinstance(content, str) else content


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str):
    raise TokenizerError(message)


@dataclass(slots=True)
class IncrementalDecoder:
    """Turns a growing token list into text deltas and applies stop strings (OpenAI semantics: the stop
    string itself is not returned; the earliest stop string found ends the answer). Holds back a tail that could
    still become a stop string.

    Offset-based, as vLLM's and TGI's detokenizers: the work per token is a decode of a short window of ids, never of
    the whole answer. `read_offset` is where the emitted text ends; `prefix_offset` starts the piece emitted before
    it, decoded again with the new ids so that byte-level merges across the boundary come out as a full decode
    would. The window moves on when it ends on a whole character. While it ends in U+FFFD (an incomplete UTF-8
    sequence, which the next id may complete) the new ids are held back, but for at most `max_hold_ids` ids: then
    the text up to the last id boundary that splits the window cleanly is emitted (only the last U+FFFD of a
    decode can still change), so answers the model makes of undecodable ids stream in time linear in their length.
    """

    tokenizer: FamilyTokenizer
    stop_strings: tuple[str, ...] = ()
    max_hold_ids: int = 8
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    prefix_text: str = ""            # decode(token_ids[prefix_offset:read_offset])
    held: str = ""                   # decoded, not yet emitted: it could be the start of a stop string
    stopped: bool = False
    _holdback: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._holdback = max((len(s) - 1 for s in self.stop_strings), default=0)

    def push(self, new_token_ids: list[int]) -> str:
        """Adds tokens; returns the new text safe to emit. Sets .stopped when a stop string appeared."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        return self._emit(self._advance(final=False), final=False)

    def flush(self) -> str:
        """At the end of the stream: what was held back (an incomplete character as U+FFFD, as a full decode gives
        it), stop strings still applied."""
        if self.stopped:
            return ""
        return self._emit(self._advance(final=True), final=True)

    def _advance(self, final: bool) -> str:
        """The newly decoded text that can no longer change ("" while it may)."""
        ids, decode = self.token_ids, self.tokenizer.decode
        window = decode(ids[self.prefix_offset:])
        if final or not window.endswith("\ufffd"):
            return self._move(len(ids), window)
        if len(ids) - self.read_offset < self.max_hold_ids:
            return ""                      # wait: the next id may complete the character
        # Held long enough: emit up to the latest id boundary where the window splits cleanly (the two halves
        # decode to the window), so the text before it is final; the last few ids stay held.
        for end in range(len(ids) - 1, max(self.read_offset, len(ids) - self.max_hold_ids), -1):
            head = decode(ids[self.prefix_offset:end])
            if window.startswith(head) and decode(ids[end:]) == window[len(head):]:
                return self._move(end, head)
        return self._move(len(ids), window)   # no clean boundary: the U+FFFD stands as it is

    def _move(self, end: int, text: str) -> str:
        """Text of ids[prefix_offset:end] decoded is `text`: emit its part after prefix_text, move the window."""
        delta = text[len(self.prefix_text):]
        self.prefix_offset, self.read_offset, self.prefix_text = self.read_offset, end, delta
        return delta

    def _emit(self, new: str, final: bool) -> str:
        """Stop strings over the held-back tail and the new text; holds back what could start a stop string."""
        text = self.held + new if self.held else new
        if self.stop_strings and text:
            found = [at for stop in self.stop_strings if (at := text.find(stop)) != -1]
            if found:
                self.stopped = True
                self.held = ""
                return text[:min(found)]
        end = len(text) if final else max(0, len(text) - self._holdback)
        self.held = text[end:]
        return text[:end]
